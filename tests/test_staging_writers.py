"""The SSD's write-behind queue with several writers (``pool.write_behind_threads``): batches
written at once still land in the log in the order they were queued, every byte reads back
(and survives a restart), a failing write costs exactly its batch (counted), and a sink that
refuses a batch before placing it never stalls the batches behind it.

Everything here is real: an ``SsdEngine`` on files, a segment's fd swapped (dup2) for a
read-only fd of the same file so the kernel refuses its writes (EBADF).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool import KVLayout, Namespace
from kvpool.ssd.engine import SsdEngine
from kvpool.tiers.staging import WriteBehind

MiB = 1 << 20
NS = Namespace("m", KVLayout("uint8", 1, 1, 65536, 1, kv_factor=1))
CHUNK = NS.chunk_bytes
SEG, CAP = MiB, 16 * MiB  # 14 records of 64 KiB a segment: batches cross segment ends


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") + b"writers!"


def data(i: int) -> np.ndarray:
    return np.random.default_rng(7000 + i).integers(0, 256, CHUNK, dtype=np.uint8)


def engine_at(path: Path) -> SsdEngine:
    return SsdEngine(path, CAP, SEG, durability="cache")


def read(engine: SsdEngine, i: int) -> np.ndarray | None:
    out = np.zeros(CHUNK, dtype=np.uint8)
    return out if engine.get_into(key(i), out, namespace_id=NS.id) else None


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[SsdEngine]:
    eng = engine_at(tmp_path / "ssd")
    yield eng
    eng.close()


def log_place(engine: SsdEngine, i: int) -> tuple[int, int]:
    """Where record ``i`` sits in write order: its segment's first seq, then its block."""
    loc = engine._index.get(key(i))
    assert loc is not None
    return engine._log.segments[loc.segment].start_seq, loc.block


def test_two_writers_keep_queue_order_in_the_log_and_every_byte_survives_a_restart(
        tmp_path: Path) -> None:
    eng = engine_at(tmp_path / "ssd")
    queue = WriteBehind(eng, max_bytes=256 * CHUNK, batch=3, writers=2)
    n = 100  # about 7 segments: batches are written at once and cross segment ends
    try:
        for i in range(n):
            assert queue.offer(key(i), NS, data(i))
        assert queue.flush(60)
        stats = queue.stats()
        assert (stats["written"], stats["write_errors"], stats["queued"]) == (n, 0, 0)
        places = [log_place(eng, i) for i in range(n)]
        assert places == sorted(places)  # one prefix saved in order stays one run
        for i in range(n):
            got = read(eng, i)
            assert got is not None and np.array_equal(got, data(i)), i
    finally:
        queue.close()
        eng.close()
    again = engine_at(tmp_path / "ssd")
    try:
        for i in range(n):
            got = read(again, i)
            assert got is not None and np.array_equal(got, data(i)), i
    finally:
        again.close()


def test_a_failing_write_loses_only_its_batch_and_is_counted(tmp_path: Path) -> None:
    eng = engine_at(tmp_path / "ssd")
    queue = WriteBehind(eng, max_bytes=64 * CHUNK, batch=4, writers=2)
    try:
        for i in range(4):
            queue.offer(key(i), NS, data(i))
        assert queue.flush(30)
        loc = eng._index.get(key(0))
        assert loc is not None
        fd = eng._store.fd(loc.segment)
        saved = os.dup(fd)
        read_only = os.open(os.readlink(f"/proc/self/fd/{fd}"), os.O_RDONLY)
        os.dup2(read_only, fd)  # the kernel now refuses this segment's writes (EBADF)
        os.close(read_only)
        try:
            for i in range(4, 8):  # one batch, placed in the same segment (8 of 14 records)
                queue.offer(key(i), NS, data(i))
            assert queue.flush(30)
        finally:
            os.dup2(saved, fd)
            os.close(saved)
        assert queue.stats()["write_errors"] == 4
        for i in range(8, 12):
            queue.offer(key(i), NS, data(i))
        assert queue.flush(30)
        assert queue.stats()["written"] == 8
        assert [eng.contains(key(i)) for i in range(12)] == [True] * 4 + [False] * 4 + [True] * 4
    finally:
        queue.close()
        eng.close()
    again = engine_at(tmp_path / "ssd")
    try:
        for i in [*range(4), *range(8, 12)]:
            got = read(again, i)
            assert got is not None and np.array_equal(got, data(i)), i
        assert all(read(again, i) is None for i in range(4, 8))  # never a torn record
    finally:
        again.close()


def test_a_batch_refused_before_its_place_does_not_stall_the_next(engine: SsdEngine) -> None:
    queue = WriteBehind(engine, max_bytes=64 * CHUNK, batch=2, writers=2)
    try:
        engine.close()  # every put_many now raises PoolClosedError before reserving
        for i in range(10):
            queue.offer(key(i), NS, data(i))
        assert queue.flush(30)  # five refused batches, none waiting for its turn forever
        assert queue.stats()["write_errors"] == 10
    finally:
        queue.close()


def test_writers_below_one_is_refused(engine: SsdEngine) -> None:
    with pytest.raises(ValueError, match="writers"):
        WriteBehind(engine, max_bytes=CHUNK, writers=0)
