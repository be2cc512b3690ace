"""A read the medium refuses is an ``io_error``, not a ``checksum_failure``: the record may be
intact, so a failed read path read keeps it indexed, and copy-forward drops it but says why.

The failing medium is real kernel behaviour, cheaply: the engine's fd of one segment is
swapped (dup2) for a write-only fd of the same file, so every ``preadv`` on it fails with
EBADF while writes (segment headers, records) still land. A record damaged on the medium and
met by copy-forward stays a ``checksum_failure``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from kvpool import KVLayout, Namespace
from kvpool.record import BLOCK, HEADER_BLOCK
from kvpool.ssd.engine import SsdEngine

MiB = 1 << 20
NS = Namespace("m", KVLayout("uint8", 1, 1, 65536, 1, kv_factor=1))
CHUNK = NS.chunk_bytes
SEG, CAP, PER_SEG = MiB, 4 * MiB, 14  # as in test_ssd_capacity: the log holds 56 records


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") + b"ioerrors"


def data(i: int) -> np.ndarray:
    return np.random.default_rng(3000 + i).integers(0, 256, CHUNK, dtype=np.uint8)


def read(engine: SsdEngine, i: int) -> np.ndarray | None:
    out = np.zeros(CHUNK, dtype=np.uint8)
    return out if engine.get_into(key(i), out) else None


@contextlib.contextmanager
def reads_fail(engine: SsdEngine, segment: int) -> Iterator[None]:
    """Within the block, reading ``segment`` fails in the kernel (EBADF); writing works."""
    fd = engine._store.fd(segment)
    saved = os.dup(fd)
    write_only = os.open(os.readlink(f"/proc/self/fd/{fd}"), os.O_WRONLY)
    os.dup2(write_only, fd)
    os.close(write_only)
    try:
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


def segment_of(engine: SsdEngine, i: int) -> int:
    loc = engine._index.get(key(i))
    assert loc is not None
    return loc.segment


HOT = 10**6


def full_log_with_a_hot_record(tmp_path: Path) -> SsdEngine:
    """A second_chance engine whose log is full: record HOT (read once, so eviction would copy
    it forward) in the oldest segment, then fillers 1-55; the next put evicts HOT's segment."""
    e = SsdEngine(tmp_path, CAP, SEG, "cache", eviction="second_chance")
    assert e.put(key(HOT), NS, data(HOT))
    for n in range(1, 4 * PER_SEG):
        assert e.put(key(n), NS, data(n))
    assert read(e, HOT) is not None
    assert e.stats()["segments_evicted"] == 0
    return e


def test_a_failed_read_is_an_io_error_and_keeps_the_record(tmp_path: Path) -> None:
    e = SsdEngine(tmp_path, CAP, SEG, "cache")
    try:
        assert e.put(key(0), NS, data(0))
        with reads_fail(e, segment_of(e, 0)):
            assert read(e, 0) is None
            outs = [np.zeros(CHUNK, np.uint8) for _ in range(2)]
            assert e.get_many_into([key(0), key(0)], outs) == [False, False]
        st = e.stats()
        assert st["io_errors"] == 3 and st["checksum_failures"] == 0 and st["misses"] == 3
        got = read(e, 0)  # the medium is back: the record was never dropped
        assert got is not None and np.array_equal(got, data(0))
    finally:
        e.close()


def test_a_failed_copy_forward_read_is_an_io_error(tmp_path: Path) -> None:
    e = full_log_with_a_hot_record(tmp_path)
    try:
        with reads_fail(e, segment_of(e, HOT)):
            assert e.put(key(4 * PER_SEG), NS, data(4 * PER_SEG))  # evicts HOT's segment
        st = e.stats()
        assert st["segments_evicted"] == 1 and st["copied_forward"] == 0
        assert st["io_errors"] == 1 and st["checksum_failures"] == 0
        assert not e.contains(key(HOT))
        got = read(e, 4 * PER_SEG)
        assert got is not None and np.array_equal(got, data(4 * PER_SEG))
    finally:
        e.close()


def test_a_damaged_record_met_by_copy_forward_is_a_checksum_failure(tmp_path: Path) -> None:
    e = full_log_with_a_hot_record(tmp_path)
    try:
        loc = e._index.get(key(HOT))
        assert loc is not None
        fd = e._store.fd(loc.segment)
        payload_at = e._store.base(loc.segment) + loc.block * BLOCK + HEADER_BLOCK
        raw = os.open(os.readlink(f"/proc/self/fd/{fd}"), os.O_RDWR)
        try:  # one flipped payload bit: the header still names the record
            os.pwrite(raw, bytes([os.pread(raw, 1, payload_at)[0] ^ 1]), payload_at)
            os.fsync(raw)
        finally:
            os.close(raw)
        assert e.put(key(4 * PER_SEG), NS, data(4 * PER_SEG))  # evicts HOT's segment
        st = e.stats()
        assert st["segments_evicted"] == 1 and st["copied_forward"] == 0
        assert st["checksum_failures"] == 1 and st["io_errors"] == 0
        assert not e.contains(key(HOT))
    finally:
        e.close()
