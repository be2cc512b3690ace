"""Compact in-memory index of the SSD engine: 16-byte key -> (segment, block offset, blocks).

An open-addressing hash table with linear probing over parallel numpy arrays, so a slot costs
29 bytes instead of the ~150 a Python dict of bytes -> tuple would; with a maximum load of 0.85
and 1.5x growth that is 34-51 bytes per chunk. Keys are already uniform hashes, so their first
8 bytes pick the home slot. Deleted slots become tombstones and
are reclaimed on the next resize. Not thread-safe: the engine locks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np

_EMPTY = 0
_DELETED = 0xFFFFFFFF
_MAX_LOAD = 0.85
_GROWTH = 1.5
_MIN_CAPACITY = 1024


@dataclass(frozen=True, slots=True)
class Location:
    segment: int
    block: int  # offset of the record's header block, in 4 KiB blocks
    blocks: int  # record size in 4 KiB blocks, header block included
    ns_index: int


class CompactIndex:
    def __init__(self, capacity: int = _MIN_CAPACITY) -> None:
        self._alloc(max(_MIN_CAPACITY, capacity))
        self._count = 0
        self._deleted = 0

    def _alloc(self, cap: int) -> None:
        self._cap = cap
        self.k0 = np.zeros(cap, dtype=np.uint64)
        self.k1 = np.zeros(cap, dtype=np.uint64)
        self.segment = np.zeros(cap, dtype=np.uint16)
        self.block = np.zeros(cap, dtype=np.uint32)
        self.blocks = np.zeros(cap, dtype=np.uint32)  # 0 = empty, 0xFFFFFFFF = deleted
        self.ns_index = np.zeros(cap, dtype=np.uint16)
        self.hot = np.zeros(cap, dtype=np.bool_)

    @property
    def capacity(self) -> int:
        return self._cap

    def __len__(self) -> int:
        return self._count

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.k0, self.k1, self.segment, self.block, self.blocks,
                                      self.ns_index, self.hot))

    @staticmethod
    def _split(key: bytes) -> tuple[int, int]:
        return int.from_bytes(key[:8], "little"), int.from_bytes(key[8:16], "little")

    def _find(self, a: int, b: int) -> int:
        """Slot holding (a, b), or -1."""
        i = a % self._cap
        k0, k1, blocks = self.k0, self.k1, self.blocks
        while True:
            n = int(blocks[i])
            if n == _EMPTY:
                return -1
            if n != _DELETED and int(k0[i]) == a and int(k1[i]) == b:
                return i
            i = (i + 1) % self._cap

    def get(self, key: bytes) -> Location | None:
        i = self._find(*self._split(key))
        if i < 0:
            return None
        return Location(int(self.segment[i]), int(self.block[i]), int(self.blocks[i]),
                        int(self.ns_index[i]))

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self._find(*self._split(key)) >= 0

    def mark_hot(self, key: bytes) -> None:
        i = self._find(*self._split(key))
        if i >= 0:
            self.hot[i] = True

    def put(self, key: bytes, segment: int, block: int, blocks: int, ns_index: int) -> None:
        """Insert or replace. Raises ValueError if ``blocks`` is 0 or does not fit 32 bits, or
        the segment number does not fit 16 bits."""
        if not 0 < blocks < _DELETED:
            raise ValueError(f"record size in blocks out of range: {blocks}")
        if not 0 <= segment <= 0xFFFF:
            raise ValueError(f"segment number out of range: {segment}")
        if (self._count + self._deleted + 1) > _MAX_LOAD * self.capacity:
            grow = self._count + 1 > _MAX_LOAD * self.capacity / _GROWTH
            self._resize(int(self.capacity * _GROWTH) if grow else self.capacity)
        a, b = self._split(key)
        i = a % self._cap
        first_free = -1
        while True:
            n = int(self.blocks[i])
            if n == _EMPTY:
                break
            if n == _DELETED:
                if first_free < 0:
                    first_free = i
            elif int(self.k0[i]) == a and int(self.k1[i]) == b:
                first_free = i
                self._count -= 1  # replaced below
                break
            i = (i + 1) % self._cap
        if first_free >= 0:
            if int(self.blocks[first_free]) == _DELETED:
                self._deleted -= 1
            i = first_free
        self.k0[i], self.k1[i] = a, b
        self.segment[i], self.block[i], self.blocks[i] = segment, block, blocks
        self.ns_index[i] = ns_index
        self.hot[i] = False
        self._count += 1

    def remove(self, key: bytes) -> Location | None:
        i = self._find(*self._split(key))
        if i < 0:
            return None
        loc = Location(int(self.segment[i]), int(self.block[i]), int(self.blocks[i]),
                       int(self.ns_index[i]))
        self._tombstone(np.array([i]))
        return loc

    def _tombstone(self, slots: np.ndarray) -> None:
        self.blocks[slots] = _DELETED
        self.hot[slots] = False
        self._count -= int(slots.size)
        self._deleted += int(slots.size)

    def _live(self) -> np.ndarray:
        return (self.blocks != _EMPTY) & (self.blocks != _DELETED)

    def slots_where(self, *, segment: int | None = None, ns_index: int | None = None) -> np.ndarray:
        """Slots of live entries in a segment and/or namespace (vectorised scan)."""
        mask = self._live()
        if segment is not None:
            mask &= self.segment == segment
        if ns_index is not None:
            mask &= self.ns_index == ns_index
        return cast(np.ndarray, np.flatnonzero(mask))

    def key_at(self, slot: int) -> bytes:
        return int(self.k0[slot]).to_bytes(8, "little") + int(self.k1[slot]).to_bytes(8, "little")

    def remove_slots(self, slots: np.ndarray) -> None:
        """Drop the live entries at ``slots`` (as returned by slots_where)."""
        if slots.size:
            self._tombstone(slots)

    def _resize(self, cap: int) -> None:
        live = np.flatnonzero(self._live())
        old = (self.k0[live], self.k1[live], self.segment[live], self.block[live],
               self.blocks[live], self.ns_index[live], self.hot[live])
        self._alloc(cap)
        self._count = 0
        self._deleted = 0
        for j in range(live.size):
            a, b = int(old[0][j]), int(old[1][j])
            i = a % self._cap
            while int(self.blocks[i]) != _EMPTY:
                i = (i + 1) % self._cap
            self.k0[i], self.k1[i] = a, b
            self.segment[i], self.block[i], self.blocks[i] = old[2][j], old[3][j], old[4][j]
            self.ns_index[i], self.hot[i] = old[5][j], old[6][j]
            self._count += 1
