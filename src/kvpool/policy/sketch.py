"""A count-min frequency sketch with periodic halving (TinyLFU's "reset"), bounded memory.

Four rows of small saturating counters (at most 15) in one ``bytearray``; a key's estimate
is the least of its four counters, never below its true count since the last halving. After
``sample`` increments every counter is halved, so old popularity fades: the sketch ranks
keys by their recent frequency. Width grows by doubling (each new half a copy of the old,
so no estimate drops) while the cache it serves grows, up to ``max_width``; memory is
4 bytes per column. Not thread-safe: the owning policy's caller locks.
"""

from __future__ import annotations

from collections.abc import Hashable

MAX_COUNT = 15
_ROWS = 4
_SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)
_M64 = (1 << 64) - 1


class FrequencySketch:
    """Raises ValueError for a width that is not a power of two >= 16."""

    def __init__(self, width: int = 1024, sample_factor: int = 10,
                 max_width: int = 1 << 24) -> None:
        if width < 16 or width & (width - 1):
            raise ValueError(f"sketch width must be a power of two >= 16, got {width}")
        self._width = width
        self._max_width = max(width, max_width)
        self._table = bytearray(_ROWS * width)
        self._sample_factor = sample_factor
        self._added = 0

    @property
    def width(self) -> int:
        return self._width

    def _slots(self, key: Hashable) -> list[int]:
        h = hash(key) & _M64
        w = self._width
        mask = w - 1
        return [r * w + ((((h ^ (h >> 29)) * seed) & _M64) >> 24 & mask)
                for r, seed in enumerate(_SEEDS)]

    def ensure_capacity(self, entries: int) -> None:
        """Widen (doubling, estimates kept) until the width is at least ``entries``."""
        while self._width < entries and self._width < self._max_width:
            w = self._width
            old = self._table
            new = bytearray(_ROWS * 2 * w)
            for r in range(_ROWS):
                row = old[r * w:(r + 1) * w]
                new[2 * r * w:(2 * r + 1) * w] = row
                new[(2 * r + 1) * w:(2 * r + 2) * w] = row
            self._table = new
            self._width = 2 * w

    def increment(self, key: Hashable) -> None:
        """Count one access of ``key``; halves every counter after ``sample_factor * width``
        increments."""
        t = self._table
        for i in self._slots(key):
            if t[i] < MAX_COUNT:
                t[i] += 1
        self._added += 1
        if self._added >= self._sample_factor * self._width:
            self._halve()

    def _halve(self) -> None:
        self._table = bytearray(b >> 1 for b in self._table)
        self._added //= 2

    def estimate(self, key: Hashable) -> int:
        """Accesses of ``key`` since the last halving (an over-estimate, at most 15)."""
        t = self._table
        return min(t[i] for i in self._slots(key))
