"""The SSD engine's log at segment granularity, without bytes, over kvpool's own segment policy.

``kvpool.ssd.log.SegmentLog`` appends records at the head of the active segment; when it is
full the segment is sealed and a free one opened, or, with none free, the oldest sealed segment
is evicted: its live records' ``hot`` flags (read since written) and sizes go to the segment
policy (``kvpool.policy.make_segment_policy``, the name ``ssd.eviction`` takes), whose
``copy_forward`` picks the ones rewritten at the new head, within ``copy_forward_fraction`` of a
segment; the rest are dropped. This model does the same, with records of one size
(``kvpool.record.record_size`` of a chunk) and a segment holding as many as fit beside its
summary (``kvpool.ssd.summary.room``). A chunk written again gets a new record (the engine
does not deduplicate puts); its old record is dead and never copied forward.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from kvpool.policy import SegmentPolicy, make_segment_policy
from kvpool.record import BLOCK, HEADER_BLOCK, record_size
from kvpool.ssd import summary


def records_per_segment(segment_size: int, chunk_bytes: int) -> int:
    """How many records of one chunk fit a segment beside its header block and summary."""
    rec = record_size(chunk_bytes)
    n = max(0, (segment_size - HEADER_BLOCK) // rec)
    while n > 0 and HEADER_BLOCK + n * rec + summary.room(n, 1) > segment_size:
        n -= 1
    return n


class SsdModel:
    """Raises ValueError for an unknown policy, fewer than 2 segments (the engine's minimum),
    or a chunk that does not fit a segment."""

    def __init__(self, policy: str, segments: int, segment_size: int, chunk_bytes: int,
                 copy_forward_fraction: float = 0.25) -> None:
        if segments < 2:
            raise ValueError(f"an SSD needs at least 2 segments, got {segments}")
        self.per_segment = records_per_segment(segment_size, chunk_bytes)
        if self.per_segment < 1:
            raise ValueError(f"a chunk of {chunk_bytes} bytes does not fit an SSD segment of "
                             f"{segment_size} bytes; raise --ssd-segment")
        self.policy_name = policy
        self.policy: SegmentPolicy = make_segment_policy(policy)
        self.segments = segments
        self.record_bytes = record_size(chunk_bytes)
        self._budget_blocks = int(copy_forward_fraction * segment_size) // BLOCK
        self._where: dict[int, int] = {}  # key -> segment of its live record
        self._hot: dict[int, bool] = {}
        self._records: list[list[int]] = [[] for _ in range(segments)]
        self._fifo: deque[int] = deque()
        self._free = list(range(segments - 1, -1, -1))
        self._active = -1
        self.reads = 0
        self.writes = 0  # records appended for puts and demotions
        self.forwarded = 0  # records rewritten by copy-forward
        self.dropped = 0  # live records lost with an evicted segment
        self.segments_evicted = 0

    @property
    def capacity_chunks(self) -> int:
        return self.segments * self.per_segment

    def __contains__(self, key: int) -> bool:
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)

    def read(self, key: int) -> None:
        """A hit: the record is marked hot (as ``get_many_into`` marks it in the index)."""
        self._hot[key] = True
        self.reads += 1

    def write(self, key: int) -> None:
        """Append a record for ``key`` at the head, rolling to a new segment when full."""
        if self._active < 0 or len(self._records[self._active]) >= self.per_segment:
            self._roll()
        self._place(key)
        self.writes += 1

    def _place(self, key: int) -> None:
        self._where[key] = self._active
        self._hot[key] = False
        self._records[self._active].append(key)

    def _roll(self) -> None:
        if self._active >= 0:
            self._fifo.append(self._active)
        if self._free:
            self._active = self._free.pop()
            return
        victim = self._fifo.popleft()
        where = self._where
        live = [k for k in dict.fromkeys(self._records[victim]) if where.get(k) == victim]
        hot = np.fromiter((self._hot[k] for k in live), dtype=bool, count=len(live))
        blocks = np.full(len(live), self.record_bytes // BLOCK, dtype=np.int64)
        picked = self.policy.copy_forward(hot, blocks, self._budget_blocks)
        for k in live:
            del where[k]
            del self._hot[k]
        self._records[victim] = []
        self.segments_evicted += 1
        self._active = victim  # the freed segment is the new head, as in the engine
        forward = [live[int(i)] for i in picked][:self.per_segment]
        for k in forward:
            self._place(k)
        self.forwarded += len(forward)
        self.dropped += len(live) - len(forward)
