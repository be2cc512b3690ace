"""Reads the SSD engine did not serve itself, queued for its index's copy-forward flags.

A chunk served from DRAM (or read on another replica, a TOUCH) is hot, but its SSD record is
never read, so second_chance eviction would drop it with its segment and a restart, which
empties DRAM, would lose it. ``ReadMarks`` lets the pool report those reads on the read path
without taking the engine lock: ``add`` appends the keys to a bounded queue (a C-level
``deque.extend``, no lock); the engine applies the queue to its index, under its lock, in
batches of ``batch`` keys (deduplicated first: a hot set read again and again costs one probe
per key per batch) and in full before it picks a segment to evict (segment log), so no read
reported before a roll is missed by it.

Failure contract: best effort, never raises and never waits. When more than ``limit`` keys
are queued (the engine lock stayed busy for a long burst) the oldest are dropped, counted as
``marks_dropped``; a dropped mark costs only that record's second chance.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class ReadMarks:
    """Thread-safe without a lock: ``add`` from any thread, ``take`` under the engine lock."""

    def __init__(self, batch: int = 1024, limit: int = 1 << 16) -> None:
        self.batch = batch
        self._limit = limit
        self._keys: deque[bytes] = deque(maxlen=limit)
        #: Marks dropped because the queue was full (read by the engine's stats).
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, keys: Sequence[bytes]) -> bool:
        """Queue reads of ``keys``; True when a batch is due (the caller then applies one if
        it can take the engine lock without waiting)."""
        over = len(self._keys) + len(keys) - self._limit
        if over > 0:
            self.dropped += over  # a racy count of a best-effort drop: good enough
        self._keys.extend(keys)
        return len(self._keys) >= self.batch

    def take(self, max_keys: int | None = None) -> list[bytes]:
        """Up to ``max_keys`` queued keys (all, if None), oldest first, deduplicated."""
        n = len(self._keys) if max_keys is None else min(max_keys, len(self._keys))
        pop = self._keys.popleft
        taken = []
        try:
            for _ in range(n):
                taken.append(pop())
        except IndexError:  # another thread took them meanwhile
            pass
        return list(dict.fromkeys(taken))
