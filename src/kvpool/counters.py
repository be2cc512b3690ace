"""Event counters that several threads bump (IO threads, prefetch, fan-out, callers).

A bare ``counts[name] += n`` is a read, an add and a store: two threads can interleave them and
one increment is lost. ``Counters.add`` holds a lock for just the update, so every count is
exact under any interleaving; the cost is one uncontended lock per ``add`` (well under a
microsecond), so a hot loop should add its total once rather than once per item. Counts kept
under a lock the owner holds anyway (the DRAM tier's, the write-behind queue's) need no helper.
"""

from __future__ import annotations

import threading


class Counters:
    """Named integer counts, each starting at 0. ``names`` are the counts present from the
    start (``snapshot`` shows them even at 0); ``add`` creates any other on first use."""

    __slots__ = ("_lock", "_values")

    def __init__(self, *names: str) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = dict.fromkeys(names, 0)

    def add(self, name: str, n: int = 1) -> None:
        """Add ``n`` (which may be 0 or negative) to ``name``. Never raises."""
        with self._lock:
            self._values[name] = self._values.get(name, 0) + n

    def add_many(self, pairs: dict[str, int]) -> None:
        """Add several counts under one lock acquisition. Never raises."""
        with self._lock:
            values = self._values
            for name, n in pairs.items():
                values[name] = values.get(name, 0) + n

    def __getitem__(self, name: str) -> int:
        """The count of ``name``; 0 for a name never added to."""
        with self._lock:
            return self._values.get(name, 0)

    def snapshot(self) -> dict[str, int]:
        """A copy of every count, taken at one instant."""
        with self._lock:
            return dict(self._values)
