"""A segment roll does its IO outside the engine lock: writers wait for the roll, index probes
and reads do not; and whatever threads do across rolls with copy-forward, a read is a miss or
the exact bytes written."""

from __future__ import annotations

import contextlib
import os
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool import KVLayout, Namespace
from kvpool.errors import PoolClosedError
from kvpool.ssd.engine import SsdEngine

NS = Namespace("m", KVLayout("uint8", 1, 1, 4096, 1, kv_factor=1))
CHUNK = NS.chunk_bytes
SEG = 64 << 10  # a handful of records per segment: rolls every few puts
CAP = 4 * SEG
HOT = [10**6 + i for i in range(2)]


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") + b"rolltest"


def data(i: int) -> np.ndarray:
    return np.random.default_rng(7000 + i).integers(0, 256, CHUNK, dtype=np.uint8)


def read(engine: SsdEngine, i: int) -> np.ndarray | None:
    out = np.zeros(CHUNK, dtype=np.uint8)
    return out if engine.get_into(key(i), out) else None


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[SsdEngine]:
    e = SsdEngine(tmp_path, CAP, SEG, "cache", eviction="second_chance",
                  copy_forward_fraction=0.5)
    yield e
    e.close()


class Parked:
    """Wraps one of the log's IO steps so that the first call meeting ``when`` stops inside
    it until released: a test hook that only controls timing (the real IO still runs, on the
    real files, once released), standing in for a slow device."""

    def __init__(self, obj: Any, name: str, when: Callable[..., bool]) -> None:
        self.inside = threading.Event()
        self.release = threading.Event()
        real = getattr(obj, name)

        def parked(*args: Any) -> Any:
            if not self.inside.is_set() and when(*args):
                self.inside.set()
                self.release.wait()
            return real(*args)

        setattr(obj, name, parked)


def fill_with_hot_victim(e: SsdEngine) -> int:
    """HOT records (read once, so second_chance copies them forward) in the oldest segment,
    then fillers until the log is full. Returns the next filler number."""
    for i in HOT:
        assert e.put(key(i), NS, data(i))
    for i in HOT:
        assert read(e, i) is not None
    n = 0
    while e.stats()["free_segments"]:
        assert e.put(key(n), NS, data(n))
        n += 1
    assert e.stats()["segments_evicted"] == 0
    return n


def probe_while_parked(parked: Parked, probe: Callable[[], Any]) -> Any:
    """Run ``probe`` on a thread while the roll is parked inside its IO. The join timeout is
    a deadlock guard (a probe waiting for the roll would never return), not a measurement."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(probe()))
    thread.start()
    thread.join(timeout=60)
    done = not thread.is_alive()
    parked.release.set()  # let the roll go whatever happened, so nothing hangs
    thread.join()
    assert done, "the probe waited for the roll's IO"
    return result[0]


def roll_in_background(e: SsdEngine, first: int) -> threading.Thread:
    """Put fillers from ``first`` on until the log evicts (the parked step stops it there)."""
    def writer() -> None:
        n = first
        while not e.stats()["segments_evicted"]:
            assert e.put(key(n), NS, data(n))
            n += 1

    thread = threading.Thread(target=writer)
    thread.start()
    return thread


def test_index_probes_and_reads_complete_while_a_roll_reads_its_victim(
        engine: SsdEngine) -> None:
    n = fill_with_hot_victim(engine)
    parked = Parked(engine._log, "_read_block", lambda *a: True)  # copy-forward reads only
    writer = roll_in_background(engine, n)
    try:
        assert parked.inside.wait(timeout=60)

        def probe() -> tuple[list[bool], bool, np.ndarray | None, bool]:
            # The victim is still indexed (and intact) until its entries are dropped.
            return (engine.contains_many([key(i) for i in [*HOT, 0, n - 1]], NS.id),
                    engine.contains(key(n - 1)), read(engine, n - 1), engine.touch(key(n - 1)))

        held, contains, got, touched = probe_while_parked(parked, probe)
        assert held == [True, True, True, True] and contains and touched
        assert got is not None and np.array_equal(got, data(n - 1))
    finally:
        parked.release.set()
        writer.join()
    st = engine.stats()
    assert st["segments_evicted"] == 1 and st["copied_forward"] == len(HOT)
    assert st.get("touch_skipped", 0) == 0 and st["checksum_failures"] == 0
    for i in HOT:  # copied forward: still there, byte-exact
        got = read(engine, i)
        assert got is not None and np.array_equal(got, data(i))
    assert not engine.contains(key(0))  # a cold record of the victim: evicted


def test_copied_forward_records_are_indexed_only_once_their_new_copy_landed(
        engine: SsdEngine) -> None:
    n = fill_with_hot_victim(engine)
    # Parked before the new head's header and forward records are written (only the roll
    # that has records to copy forward).
    parked = Parked(engine._log, "_write_head", lambda seg_no, start_seq, placed: bool(placed))
    writer = roll_in_background(engine, n)
    try:
        assert parked.inside.wait(timeout=60)
        # The victim is being reused: its entries are gone, the forwarded ones not yet back.
        held = probe_while_parked(parked, lambda: engine.contains_many(
            [key(i) for i in [*HOT, 0, n - 1]], NS.id))
        assert held == [False, False, False, True]
    finally:
        parked.release.set()
        writer.join()
    assert engine.contains_many([key(i) for i in HOT], NS.id) == [True, True]
    for i in HOT:
        got = read(engine, i)
        assert got is not None and np.array_equal(got, data(i))


def test_threads_putting_and_reading_across_rolls_read_misses_or_exact_bytes(
        engine: SsdEngine) -> None:
    writers, per_writer, readers = 4, 120, 3
    written: list[int] = []  # appended once a put returned
    wrong: list[int] = []
    done = threading.Event()

    def write(w: int) -> None:
        for j in range(per_writer):
            i = w * per_writer + j
            assert engine.put(key(i), NS, data(i))
            written.append(i)

    def read_back(seed: int) -> None:
        rng = random.Random(seed)
        out = np.zeros(CHUNK, dtype=np.uint8)
        while not done.is_set() or rng.random() < 0.5:
            if not written:
                continue
            batch = [rng.choice(written) for _ in range(4)]
            engine.contains_many([key(i) for i in batch], NS.id)
            for i in batch[:2]:
                if engine.get_into(key(i), out) and not np.array_equal(out, data(i)):
                    wrong.append(i)
            outs = [np.zeros(CHUNK, dtype=np.uint8) for _ in batch[2:]]
            hits = engine.get_many_into([key(i) for i in batch[2:]], outs)
            wrong.extend(i for i, o, hit in zip(batch[2:], outs, hits, strict=True)
                         if hit and not np.array_equal(o, data(i)))

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    pollers = [threading.Thread(target=read_back, args=(r,)) for r in range(readers)]
    for t in [*threads, *pollers]:
        t.start()
    for t in threads:
        t.join()
    done.set()
    for t in pollers:
        t.join()
    assert not wrong
    st = engine.stats()
    assert st["puts"] == writers * per_writer
    assert st["segments_evicted"] >= 10 and st["copied_forward"] > 0
    # What the index still holds reads back exact, copied forward or not.
    for i in written:
        if engine.contains(key(i)):
            got = read(engine, i)
            assert got is not None and np.array_equal(got, data(i)), i


@contextlib.contextmanager
def writes_fail(engine: SsdEngine, segment: int) -> Iterator[None]:
    """Within the block, writing ``segment`` fails in the kernel (EBADF: its fd is swapped
    for a read-only one of the same file); reading works."""
    fd = engine._store.fd(segment)
    saved = os.dup(fd)
    read_only = os.open(os.readlink(f"/proc/self/fd/{fd}"), os.O_RDONLY)
    os.dup2(read_only, fd)
    os.close(read_only)
    try:
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


def test_a_failed_header_write_gives_the_segment_back(engine: SsdEngine) -> None:
    n = fill_with_hot_victim(engine)
    loc = engine._index.get(key(HOT[0]))
    assert loc is not None
    with writes_fail(engine, loc.segment), pytest.raises(OSError):  # the victim is reused
        while True:
            engine.put(key(n), NS, data(n))
            n += 1
    st = engine.stats()
    assert st["segments_evicted"] == 1 and st["free_segments"] == 1
    assert st["copied_forward"] == 0 and not engine.contains(key(HOT[0]))
    assert engine.put(key(n), NS, data(n))  # the next roll takes the segment again
    got = read(engine, n)
    assert got is not None and np.array_equal(got, data(n))
    assert engine.stats()["free_segments"] == 0


def test_close_during_a_roll_waits_for_its_io(tmp_path: Path) -> None:
    e = SsdEngine(tmp_path, CAP, SEG, "cache", eviction="second_chance",
                  copy_forward_fraction=0.5)
    n = fill_with_hot_victim(e)
    parked = Parked(e._log, "_read_block", lambda *a: True)
    writer = roll_in_background(e, n)
    assert parked.inside.wait(timeout=60)
    closer = threading.Thread(target=e.close)
    closer.start()
    closer.join(timeout=0.2)
    still_waiting = closer.is_alive()  # it cannot finish while the roll is parked
    parked.release.set()
    writer.join()
    closer.join()
    assert still_waiting
    # The roll's IO and the put that triggered it landed on open files: nothing failed.
    st = e.stats()
    assert st["segments_evicted"] == 1 and st["copied_forward"] == len(HOT)
    assert st["io_errors"] == 0
    with pytest.raises(PoolClosedError):
        e.put(key(10**7), NS, data(0))
