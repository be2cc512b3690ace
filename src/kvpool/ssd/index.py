"""Compact in-memory index of the SSD engine: 16-byte key -> (segment, block offset, blocks).

An open-addressing hash table with linear probing over parallel typed arrays, so a slot costs
29 bytes instead of the ~150 a Python dict of bytes -> tuple would; with a maximum load of 0.85
and 1.5x growth that is 34-51 bytes per chunk. Keys are already uniform hashes, so their first
8 bytes pick the home slot. Columns are ``array.array`` (single-element access is ~3x faster
than numpy scalars on the per-key path); whole-table scans (a segment's or a namespace's
entries) go through zero-copy numpy views of the same memory. Deleted slots become tombstones
and are reclaimed on the next resize. Not thread-safe: the engine locks.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterable
from typing import NamedTuple, Protocol, cast

import numpy as np

_EMPTY = 0
_DELETED = 0xFFFFFFFF
_MAX_LOAD = 0.85
_GROWTH = 1.5
_MIN_CAPACITY = 1024
_KEY_HALVES = struct.Struct("<QQ").unpack  # a 16-byte key as its two little-endian halves
_COLUMNS = (("k0", "Q", np.uint64), ("k1", "Q", np.uint64), ("segment", "H", np.uint16),
            ("block", "I", np.uint32), ("blocks", "I", np.uint32), ("ns_index", "H", np.uint16),
            ("hot", "B", np.uint8))


class Location(NamedTuple):
    """Where a record lies (immutable; a NamedTuple: one is built per key read)."""

    segment: int
    block: int  # offset of the record's header block, in 4 KiB blocks
    blocks: int  # record size in 4 KiB blocks, header block included
    ns_index: int


class IndexObserver(Protocol):
    """Told of every key that enters or leaves the index (KV events, docs/routing.md),
    under the engine lock: each call must return at once and never raise."""

    def added(self, key: bytes, ns_index: int) -> None: ...

    def removed(self, keys: list[bytes], ns_indexes: list[int]) -> None: ...

    def cleared(self, ns_index: int) -> None: ...


class CompactIndex:
    def __init__(self, capacity: int = _MIN_CAPACITY) -> None:
        self._alloc(max(_MIN_CAPACITY, capacity))
        self._count = 0
        self._deleted = 0
        #: None: nobody listens (recovery runs before one is attached).
        self.observer: IndexObserver | None = None

    def _alloc(self, cap: int) -> None:
        self._cap = cap
        cols = {name: array(code, bytes(cap * array(code).itemsize)) for name, code, _ in _COLUMNS}
        self._k0, self._k1 = cols["k0"], cols["k1"]
        self._segment, self._block, self._blocks = cols["segment"], cols["block"], cols["blocks"]
        self._ns_index, self._hot = cols["ns_index"], cols["hot"]
        self._cols = cols

    def column(self, name: str) -> np.ndarray:
        """Zero-copy numpy view of one column (k0, k1, segment, block, blocks, ns_index, hot);
        valid until the next insert (which may resize)."""
        dtype = next(d for n, _, d in _COLUMNS if n == name)
        return np.frombuffer(self._cols[name], dtype=dtype)

    @property
    def capacity(self) -> int:
        return self._cap

    def __len__(self) -> int:
        return self._count

    def nbytes(self) -> int:
        return sum(len(a) * a.itemsize for a in self._cols.values())

    @staticmethod
    def _split(key: bytes) -> tuple[int, int]:
        try:
            a, b = _KEY_HALVES(key)
            return a, b
        except struct.error:  # not 16 bytes: matches no stored key, as any other absent one
            return int.from_bytes(key[:8], "little"), int.from_bytes(key[8:16], "little")

    def _find(self, a: int, b: int) -> int:
        """Slot holding (a, b), or -1."""
        cap = self._cap
        i = a % cap
        k0, k1, blocks = self._k0, self._k1, self._blocks
        while True:
            n = blocks[i]
            if n == _EMPTY:
                return -1
            if n != _DELETED and k0[i] == a and k1[i] == b:
                return i
            i += 1
            if i == cap:
                i = 0

    def _location(self, i: int) -> Location:
        return Location(self._segment[i], self._block[i], self._blocks[i], self._ns_index[i])

    def get(self, key: bytes, mark_hot: bool = False) -> Location | None:
        """The key's location, or None. ``mark_hot`` records a read for copy-forward."""
        i = self._find(*self._split(key))
        if i < 0:
            return None
        if mark_hot:
            self._hot[i] = 1
        return Location(self._segment[i], self._block[i], self._blocks[i], self._ns_index[i])

    def get_many(self, keys: Iterable[bytes], mark_hot: bool = False) -> list[Location | None]:
        """``get`` for each key, in order (the probe loop inlined: a batch read looks up
        every key of a prefix under one lock hold)."""
        cap, k0, k1, blocks, hot = self._cap, self._k0, self._k1, self._blocks, self._hot
        segment, block, ns_index = self._segment, self._block, self._ns_index
        found: list[Location | None] = []
        for key in keys:
            try:
                a, b = _KEY_HALVES(key)
            except struct.error:
                a, b = self._split(key)
            i = a % cap
            while True:
                n = blocks[i]
                if n == _EMPTY:
                    found.append(None)
                    break
                if n != _DELETED and k0[i] == a and k1[i] == b:
                    if mark_hot:
                        hot[i] = 1
                    found.append(Location(segment[i], block[i], n, ns_index[i]))
                    break
                i += 1
                if i == cap:
                    i = 0
        return found

    def mark_hot_many(self, keys: Iterable[bytes]) -> int:
        """Record a read of each key for copy-forward (``get(key, mark_hot=True)`` without
        building its Location); returns how many were indexed."""
        cap, k0, k1, blocks, hot = self._cap, self._k0, self._k1, self._blocks, self._hot
        marked = 0
        for key in keys:
            try:
                a, b = _KEY_HALVES(key)
            except struct.error:
                continue  # not 16 bytes: never indexed
            i = a % cap
            while True:
                n = blocks[i]
                if n == _EMPTY:
                    break
                if n != _DELETED and k0[i] == a and k1[i] == b:
                    hot[i] = 1
                    marked += 1
                    break
                i += 1
                if i == cap:
                    i = 0
        return marked

    def ns_index_of(self, key: bytes) -> int:
        """The key's namespace index, or -1 if it is not indexed."""
        i = self._find(*self._split(key))
        return -1 if i < 0 else int(self._ns_index[i])

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self._find(*self._split(key)) >= 0

    def put(self, key: bytes, segment: int, block: int, blocks: int, ns_index: int) -> None:
        """Insert or replace. Raises ValueError if ``blocks`` is 0 or does not fit 32 bits, or
        the segment number does not fit 16 bits."""
        if not 0 < blocks < _DELETED:
            raise ValueError(f"record size in blocks out of range: {blocks}")
        if not 0 <= segment <= 0xFFFF:
            raise ValueError(f"segment number out of range: {segment}")
        if (self._count + self._deleted + 1) > _MAX_LOAD * self._cap:
            grow = self._count + 1 > _MAX_LOAD * self._cap / _GROWTH
            self._resize(int(self._cap * _GROWTH) if grow else self._cap)
        a, b = self._split(key)
        cap = self._cap
        i = a % cap
        free = -1
        replaced = False
        while True:
            n = self._blocks[i]
            if n == _EMPTY:
                break
            if n == _DELETED:
                if free < 0:
                    free = i
            elif self._k0[i] == a and self._k1[i] == b:
                free = i
                self._count -= 1  # replaced below
                replaced = True
                break
            i = i + 1 if i + 1 < cap else 0
        if free >= 0:
            if self._blocks[free] == _DELETED:
                self._deleted -= 1
            i = free
        self._store(i, a, b, segment, block, blocks, ns_index, 0)
        self._count += 1
        if self.observer is not None and not replaced:
            self.observer.added(bytes(key), ns_index)

    def _store(self, i: int, a: int, b: int, segment: int, block: int, blocks: int,
               ns_index: int, hot: int) -> None:
        self._k0[i], self._k1[i] = a, b
        self._segment[i], self._block[i], self._blocks[i] = segment, block, blocks
        self._ns_index[i], self._hot[i] = ns_index, hot

    def remove(self, key: bytes) -> Location | None:
        i = self._find(*self._split(key))
        if i < 0:
            return None
        loc = self._location(i)
        self._blocks[i] = _DELETED
        self._hot[i] = 0
        self._count -= 1
        self._deleted += 1
        if self.observer is not None:
            self.observer.removed([bytes(key)], [loc.ns_index])
        return loc

    def slots_where(self, *, segment: int | None = None, ns_index: int | None = None) -> np.ndarray:
        """Slots of live entries in a segment and/or namespace (vectorised scan)."""
        blocks = self.column("blocks")
        mask = (blocks != _EMPTY) & (blocks != _DELETED)
        if segment is not None:
            mask &= self.column("segment") == segment
        if ns_index is not None:
            mask &= self.column("ns_index") == ns_index
        return cast(np.ndarray, np.flatnonzero(mask))

    def key_at(self, slot: int) -> bytes:
        return self._k0[slot].to_bytes(8, "little") + self._k1[slot].to_bytes(8, "little")

    def remove_slots(self, slots: np.ndarray, cleared_ns: int | None = None) -> None:
        """Drop the live entries at ``slots`` (as returned by slots_where). ``cleared_ns``:
        they are all of that namespace, dropped as a whole (the observer hears one
        ``cleared`` instead of every key)."""
        if slots.size and self.observer is not None:
            if cleared_ns is not None:
                self.observer.cleared(cleared_ns)
            else:
                ns_col = self.column("ns_index")
                self.observer.removed([self.key_at(int(s)) for s in slots],
                                      [int(ns_col[s]) for s in slots])
        if slots.size:
            self.column("blocks")[slots] = _DELETED
            self.column("hot")[slots] = 0
            self._count -= int(slots.size)
            self._deleted += int(slots.size)

    def reserve(self, count: int) -> None:
        """Grow once so that ``count`` entries fit without a resize (recovery knows how
        many records it is about to insert)."""
        if count + self._deleted > _MAX_LOAD * self._cap:
            self._resize(max(self._cap, int(count / _MAX_LOAD) + 1))

    def _resize(self, cap: int) -> None:
        """Rebuild the table at ``cap`` slots (dropping tombstones), vectorised: it runs
        under the engine lock, and a per-slot Python loop held it ~1.5 s per million
        entries. Each round places, for every slot wanted by entries not yet placed, one of
        them, and moves the rest one slot on; an entry therefore ends past a run of occupied
        slots from its home slot, as linear probing requires."""
        blocks = self.column("blocks")
        live = np.flatnonzero((blocks != _EMPTY) & (blocks != _DELETED))
        old = {name: self.column(name)[live] for name, _, _ in _COLUMNS}  # copies
        self._alloc(cap)
        self._deleted = 0
        self._count = int(live.size)
        if not live.size:
            return
        pos = (old["k0"] % np.uint64(cap)).astype(np.int64)
        owner = np.full(cap, -1, dtype=np.int64)
        todo = np.arange(live.size, dtype=np.int64)
        while todo.size:
            want = pos[todo]
            free = owner[want] < 0
            bidders, slots = todo[free], want[free]
            owner[slots] = bidders  # one bidder per slot wins (whichever numpy keeps)
            placed = np.zeros(live.size, dtype=bool)
            placed[bidders[owner[slots] == bidders]] = True
            todo = todo[~placed[todo]]
            pos[todo] = (pos[todo] + 1) % cap
        where = np.flatnonzero(owner >= 0)
        order = owner[where]
        for name, _, _ in _COLUMNS:
            self.column(name)[where] = old[name][order]


class NamespaceIds:
    """The 16-bit number the index stores per record for each namespace id (the SSD engine's
    table; not thread-safe, used under the engine lock)."""

    def __init__(self) -> None:
        self._ids: list[bytes] = []
        self._numbers: dict[bytes, int] = {}

    def number(self, namespace_id: bytes) -> int:
        """The namespace's number, given one on first use. Raises ValueError past 65535."""
        idx = self._numbers.get(namespace_id)
        if idx is None:
            if len(self._ids) >= 0xFFFF:
                raise ValueError("more than 65535 namespaces on one SSD engine")
            idx = len(self._ids)
            self._ids.append(namespace_id)
            self._numbers[namespace_id] = idx
        return idx

    def find(self, namespace_id: bytes) -> int:
        """The namespace's number, or -1 if it never had one."""
        return self._numbers.get(namespace_id, -1)

    def id_of(self, number: int) -> bytes:
        return self._ids[number]
