"""The DRAM tier's read directory: where each resident chunk lies, in shared memory, so an
attached engine reads a DRAM hit without asking the host pool (no round trip, no pin).

The host pool's DRAM tier keeps it under its own lock (``ReadDirectory``: publish a chunk at
its commit, withdraw it before its slot can hold anything else); engines map it read-only
(``DirectoryReader``) beside the arena. A table of ``buckets x WAYS`` entries of eight
uint64 each: a sequence number, the key, the namespace id, the slot's offset and size, and
the TTL deadline (float64 bits). A key lives in one bucket (a hash of its 16 bytes) or
nowhere (a full bucket: that chunk is read through the host pool, as before).

Why no pin: each entry is a seqlock. Its sequence is odd while the entry is live and moves
on (to even) when the chunk is withdrawn, which the tier does before the slot is handed to
anyone else (evicted, deleted, expired, its slab stolen); a republished entry is odd again,
two further. A reader takes an entry's sequence, then its fields, copies the slot, and takes
the sequence again: equal and odd means the slot held that key's bytes for the whole copy.
That reasoning needs loads kept in program order and stores seen in causal order, which
x86-64 (TSO) gives for plain loads and stores; elsewhere ``DIRECT_READS_SUPPORTED`` is False
and engines keep asking the host pool. Separate numpy calls keep the compiler from moving
the loads across each other.

Failure contract: a reader never raises for what it finds in the table; an entry that is
torn, stale, of another namespace, of another size, expired, or pointing outside the arena
is a miss here (the engine asks the host pool). ``ReadDirectory`` raises OSError when the
kernel cannot create the shared file.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import mmap
import os
import platform
import time
from collections.abc import Sequence

import numpy as np

#: Entries per bucket: a key may sit in any way of its bucket.
WAYS = 8
#: uint64 fields per entry, and their columns.
FIELDS = 8
SEQ, KEY_A, KEY_B, NS_A, NS_B, OFFSET, SIZE, EXPIRES = range(FIELDS)
ENTRY_BYTES = FIELDS * 8
#: Reading without a pin relies on x86-64's ordering (module docstring).
DIRECT_READS_SUPPORTED = platform.machine() in ("x86_64", "AMD64")

_MASK64 = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15  # the golden-ratio multiplier: spreads structured test keys
_F_SEAL_FUTURE_WRITE = 0x0010  # linux/fcntl.h (5.1+); Python's fcntl lacks the name
_WAY_OFFSETS = np.arange(WAYS, dtype=np.uint64)
assert WAYS == 8  # _rows shifts by 3
#: An entry as the reader sees it: the key and namespace id compared as one 32-byte value.
_ENTRY = np.dtype([("seq", "<u8"), ("key", "V16"), ("ns", "V16"), ("offset", "<u8"),
                   ("size", "<u8"), ("expires", "<f8")])
#: Entries at least: 8 buckets (a shift below 64).
MIN_ENTRIES = 64
_NO_ROWS = np.zeros(0, np.uint64)
#: A found entry as a reader remembers it (DirectoryReader._known), and at most how many.
_Found = tuple[int, int, int, float]
_KNOWN_MAX = 1 << 16
_KNOWN_NAMESPACES = 16


def entries_for(capacity: int, chunk_hint: int = 32 << 10) -> int:
    """The default table size: two entries per ``chunk_hint`` bytes of arena, a power of two
    of at least 4,096 and at most 2**24 (1 GiB of table)."""
    want = max(4096, 2 * capacity // chunk_hint)
    return 1 << min(24, math.ceil(math.log2(want)))


def _bucket(key: bytes, shift: int) -> int:
    """The bucket of one key: the top bits of its first 8 bytes times the golden ratio
    (Fibonacci hashing; as ``_rows``, for the writer)."""
    return ((int.from_bytes(key[:8], "little") * _MIX) & _MASK64) >> shift


def _rows(joined: bytes, shift: int) -> np.ndarray:
    """The (n, WAYS) entries of the buckets of n keys given back to back."""
    first = np.frombuffer(joined, "<u8")[::2]
    out: np.ndarray = (((first * np.uint64(_MIX)) >> np.uint64(shift)) << np.uint64(3))[
        :, None] | _WAY_OFFSETS
    return out


def _shift(entries: int) -> int:
    """How far a 64-bit hash moves right to leave a bucket number (entries / WAYS)."""
    return 64 - (entries // WAYS).bit_length() + 1


def _words(raw: bytes) -> tuple[int, int]:
    return int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:16], "little")


class ReadDirectory:
    """The writer: owned by one DRAM tier, called under that tier's lock only (not
    thread-safe on its own). ``fd`` is what engines map (sealed: no one can map it writable
    again or resize it)."""

    def __init__(self, entries: int) -> None:
        if entries < MIN_ENTRIES or entries & (entries - 1):
            raise ValueError(f"directory entries must be a power of two >= {MIN_ENTRIES}, "
                             f"got {entries}")
        self.entries = entries
        self.nbytes = entries * ENTRY_BYTES
        self._shift = _shift(entries)
        self.fd = os.memfd_create("kvpool-directory",
                                  os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.nbytes)
            self._map = mmap.mmap(self.fd, self.nbytes, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
            try:  # engines map it read-only and can never map it writable
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, seals | _F_SEAL_FUTURE_WRITE)
            except OSError:  # a kernel before 5.1: size seals only
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, seals)
        except BaseException:
            os.close(self.fd)
            raise
        self._table = np.frombuffer(self._map, np.uint64).reshape(entries, FIELDS)
        self._expires = self._table.view(np.float64)[:, EXPIRES]
        self._live = bytearray(entries)  # 1 where an entry is published (find: C speed)
        self._where: dict[bytes, int] = {}  # key -> its entry
        self.full_buckets = 0  # publishes that found no free way (read via the host pool)

    def __len__(self) -> int:
        return len(self._where)

    def publish(self, key: bytes, ns_id: bytes, offset: int, nbytes: int,
                expires: float = math.inf) -> bool:
        """Make a committed chunk readable; a key already published is withdrawn first
        (its readers see the sequence move). False when its bucket is full."""
        self.withdraw(key)
        base = _bucket(key, self._shift) * WAYS
        row = self._live.find(0, base, base + WAYS)
        if row < 0:
            self.full_buckets += 1
            return False
        ka, kb = _words(key)
        na, nb = _words(ns_id)
        table = self._table
        table[row, KEY_A:EXPIRES] = (ka, kb, na, nb, offset, nbytes)
        self._expires[row] = expires
        table[row, SEQ] += 1  # even (free) -> odd (live), after the fields
        self._live[row] = 1
        self._where[key] = row
        return True

    def withdraw(self, key: bytes) -> None:
        """The chunk's slot may hold other bytes from now on: readers of it miss. Call
        before the slot is handed to anyone else; unknown keys are ignored."""
        row = self._where.pop(key, None)
        if row is not None:
            self._table[row, SEQ] += 1  # odd (live) -> even (free)
            self._live[row] = 0

    def expiry(self, key: bytes, expires: float) -> None:
        """A published chunk's TTL deadline changed (withdrawn and published again)."""
        row = self._where.get(key)
        if row is not None and self._expires[row] != expires:
            table = self._table
            ns = table[row, NS_A:NS_B + 1].astype("<u8").tobytes()
            self.publish(key, ns, int(table[row, OFFSET]), int(table[row, SIZE]), expires)

    def clear(self) -> None:
        """Withdraw every chunk (the tier is closing)."""
        for key in list(self._where):
            self.withdraw(key)

    def close(self) -> None:
        """Withdraw everything and release this process's mapping and descriptor; engines'
        mappings stay valid (and empty of live entries) until they unmap. Idempotent."""
        if self.fd < 0:
            return
        self.clear()
        del self._table, self._expires
        with contextlib.suppress(BufferError):
            self._map.close()
        os.close(self.fd)
        self.fd = -1


class DirectoryReader:
    """An engine's read-only mapping of a host pool's directory (``fd`` of ``nbytes``, as
    the host sent them). Raises OSError when it cannot be mapped, ValueError for a size
    that is no table."""

    def __init__(self, fd: int, nbytes: int) -> None:
        entries = nbytes // ENTRY_BYTES
        if nbytes % ENTRY_BYTES or entries < MIN_ENTRIES or entries & (entries - 1):
            raise ValueError(f"a directory of {nbytes} bytes is no table")
        self._map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
        self._table = np.frombuffer(self._map, _ENTRY)
        self._seq = self._table["seq"]
        self._keys = self._table["key"]
        self._shift = _shift(entries)
        self.closed = False
        #: Per (namespace id, chunk size): key -> (entry, sequence, offset, TTL deadline) of
        #: what ``find`` found. A batch whose keys are all here, with their entries'
        #: sequences unchanged now, is answered from here: a sequence moves on any change
        #: of its entry and never comes back, so the check after the copy (``changed``)
        #: holds for it as for a fresh lookup (one gather instead of the bucket scan).
        self._known: dict[tuple[bytes, int], dict[bytes, _Found]] = {}

    def find(self, keys: Sequence[bytes], ns_id: bytes, nbytes: int, arena_bytes: int
             ) -> tuple[list[int], list[int], np.ndarray, np.ndarray]:
        """Where ``keys`` of namespace ``ns_id`` lie now: (indices into ``keys`` found,
        their slot offsets, their entries, their sequences). Copy each slot, then ask
        ``changed(entries, sequences)`` which copies may not be used. An index may come
        twice (a key moved to another way of its bucket while the ways were read: one of
        the two then changed). Nothing is found once closed."""
        n = len(keys)
        if self.closed or not n or nbytes > arena_bytes:
            return [], [], _NO_ROWS, _NO_ROWS
        known = self._known.get((ns_id, nbytes))
        if known is not None:
            got = list(map(known.get, keys))
            if None not in got:
                entries, seqs, offsets, expires = zip(*got, strict=True)
                rows = np.array(entries, np.int64)
                now = self._seq[rows]
                if min(expires) > time.time() and (now == np.array(seqs, np.uint64)).all():
                    return list(range(n)), list(offsets), rows, now
        else:
            if len(self._known) >= _KNOWN_NAMESPACES:
                self._known.clear()
            known = self._known[(ns_id, nbytes)] = {}
        at, offsets, found, seqs, expires = self._lookup(keys, ns_id, nbytes, arena_bytes)
        if len(known) + len(at) > _KNOWN_MAX:
            known.clear()
        for key in keys:
            known.pop(key, None)
        for i, entry in zip(at, zip(found.tolist(), seqs.tolist(), offsets, expires,
                                    strict=True), strict=True):
            known[keys[i]] = entry
        return at, offsets, found, seqs

    def _lookup(self, keys: Sequence[bytes], ns_id: bytes, nbytes: int, arena_bytes: int
                ) -> tuple[list[int], list[int], np.ndarray, np.ndarray, list[float]]:
        """``find`` in the table (and the TTL deadlines of what it found)."""
        joined = b"".join(keys)
        rows = _rows(joined, self._shift)
        seqs = self._seq[rows]  # first the sequences, then the fields (module docstring)
        match = (self._keys[rows] == np.frombuffer(joined, "V16")[:, None]) \
            & ((seqs & np.uint64(1)) == 1)
        flat = np.flatnonzero(match)  # in key order (a key sits in one way, or briefly two)
        entries = rows.ravel()[flat]
        chosen = self._table[entries]
        good = (chosen["ns"] == np.frombuffer(ns_id, "V16")) & (chosen["size"] == nbytes) \
            & (chosen["offset"] <= arena_bytes - nbytes) & (chosen["expires"] > time.time())
        return ((flat[good] // WAYS).tolist(), chosen["offset"][good].tolist(),
                entries[good], seqs.ravel()[flat[good]], chosen["expires"][good].tolist())

    def changed(self, entries: np.ndarray, seqs: np.ndarray) -> list[int]:
        """The positions, among the entries found, of those whose sequence is no longer the
        one ``find`` saw: their slots may have held other bytes during the copy made since
        (the others held their chunk throughout)."""
        return np.flatnonzero(self._seq[entries] != seqs).tolist()

    def close(self) -> None:
        """Find nothing from now on; the mapping goes with this object (a reader in
        another thread may still be checking sequences in it)."""
        self.closed = True
