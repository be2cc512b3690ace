"""The SSD engine at its capacity bound: wrap-around, copy-forward, restarts, concurrency,
tombstones.

Geometry: 1 MiB segments, 4 MiB capacity, 64 KiB chunks. A record is a 4 KiB header block
plus the payload; a segment also keeps a 4 KiB header and room for its summary at its end, so
14 records fill a segment and 56 fill the log.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvpool import KVLayout, Namespace
from kvpool.ssd.engine import SsdEngine
from kvpool.ssd.lock import LOCK_NAME

MiB = 1 << 20
SEG = MiB
CAP = 4 * MiB
NS = Namespace("m", KVLayout("uint8", 1, 1, 65536, 1, kv_factor=1))
CHUNK = NS.chunk_bytes
PER_SEG = 14
SEGS = CAP // SEG
assert (SEG - 2 * 4096) // (4096 + CHUNK) == PER_SEG



def run_threads(target: Callable[[int], None], n: int, errors: list[BaseException]) -> None:
    """Run ``target(0..n-1)`` on n threads to the end; fail on the first error they caught."""
    threads = [threading.Thread(target=target, args=(t,)) for t in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]

def key(i: int, salt: bytes = b"capacity") -> bytes:
    return i.to_bytes(8, "little") + salt


def data(i: int, size: int = CHUNK) -> np.ndarray:
    return np.random.default_rng(7_000_000 + i).integers(0, 256, size, dtype=np.uint8)


def read(engine: SsdEngine, i: int, size: int = CHUNK) -> np.ndarray | None:
    out = np.zeros(size, dtype=np.uint8)
    return out if engine.get_into(key(i), out) else None


def assert_exact(engine: SsdEngine, indices: list[int] | range,
                 sizes: dict[int, int] | None = None) -> None:
    for i in indices:
        size = sizes[i] if sizes is not None else CHUNK
        got = read(engine, i, size)
        assert got is not None, f"record {i} is missing"
        assert np.array_equal(got, data(i, size)), f"record {i} has wrong bytes"


def disk_bytes(path: Path) -> dict[str, int]:
    """Every file of the SSD directory but its lock file, with its size."""
    return {p.name: p.stat().st_size for p in path.iterdir() if p.name != LOCK_NAME}


def expected_live(n: int) -> int:
    """Records live after n equal 64 KiB puts into an empty log (no copy-forward)."""
    return n if n <= PER_SEG * SEGS else PER_SEG * (SEGS - 1) + (n - 1) % PER_SEG + 1


# ---------------------------------------------------------------------------- fill 20x
def test_fill_twenty_times_over(tmp_path: Path) -> None:
    e = SsdEngine(tmp_path, CAP, SEG, "cache")
    files = {f"seg-{i:05d}.kvs": SEG for i in range(SEGS)}
    total = 20 * PER_SEG * SEGS
    try:
        assert disk_bytes(tmp_path) == files
        n = 0
        while n < total:
            if n < total // 2:
                assert e.put(key(n), NS, data(n))
                n += 1
            else:  # batches that straddle segment boundaries
                batch = min(7, total - n)
                assert e.put_many([(key(i), NS, data(i)) for i in range(n, n + batch)]) == batch
                n += batch
            st = e.stats()
            assert st["used_bytes"] <= st["capacity_bytes"] == CAP
            assert st["records"] == len(e) == expected_live(n)
            assert st["segments_evicted"] == max(0, math.ceil(n / PER_SEG) - SEGS)
            if n % 97 == 0:
                assert disk_bytes(tmp_path) == files
        st = e.stats()
        assert st["puts"] == total and st["put_bytes"] == total * CHUNK
        assert st["segments_evicted"] == 20 * SEGS - SEGS
        assert st["records_evicted"] == total - PER_SEG * SEGS
        assert st["copied_forward"] == 0
        # every segment full up to the room for its summary
        assert st["used_bytes"] == SEGS * (4096 + PER_SEG * (4096 + CHUNK))
        assert st["free_segments"] == 0
        # exactly the newest 56 records are there, byte-exact; nothing older
        live = range(total - PER_SEG * SEGS, total)
        assert [i for i in range(total) if e.contains(key(i))] == list(live)
        assert_exact(e, live)
        assert e.stats()["checksum_failures"] == 0
        assert disk_bytes(tmp_path) == files
    finally:
        e.close()
    assert disk_bytes(tmp_path) == files


# ---------------------------------------------------------------------------- copy-forward
@pytest.mark.parametrize("eviction", ["second_chance", "fifo"])
def test_hot_record_survives_wraps_only_with_second_chance(tmp_path: Path,
                                                           eviction: str) -> None:
    e = SsdEngine(tmp_path, CAP, SEG, "cache", eviction=eviction)
    hot = 10**6
    try:
        assert e.put(key(hot), NS, data(hot))
        fillers = 20 * PER_SEG * SEGS
        results = []
        for n in range(1, fillers + 1):
            assert e.put(key(n), NS, data(n))
            got = read(e, hot)
            results.append(got is not None)
            if got is not None:
                assert np.array_equal(got, data(hot))
        st = e.stats()
        assert st["segments_evicted"] >= 19 * SEGS
        if eviction == "second_chance":
            assert all(results)
            assert e.contains(key(hot))
            # moved forward each time its segment is the oldest: first at filler 56 (the log
            # holds 56 records), then every 55 fillers (its new segment holds it and 13
            # fillers): at fillers 56, 111, ..., 1101, i.e. 20 times
            assert st["copied_forward"] == 20
            assert st["records_evicted"] == 1072
        else:
            # the hot record shares the first segment with fillers 1-13; the log holds 56
            # records, so filler 56 evicts that segment and with it the hot record
            assert results[:55] == [True] * 55
            assert not any(results[55:])
            assert not e.contains(key(hot))
            assert st["copied_forward"] == 0
        assert len(e) == fillers + 1 - st["records_evicted"]
        assert st["checksum_failures"] == 0 and st["stale_reads"] == 0
    finally:
        e.close()


# ---------------------------------------------------------------------------- restart
@pytest.mark.parametrize("durability", ["cache", "durable"])
def test_restart_after_wrap_restores_exactly_the_index(tmp_path: Path, durability: str) -> None:
    rng = random.Random(3)
    sizes = {i: rng.choice([1, 4095, 4096, 4097, 30000, CHUNK, 200_000]) for i in range(2000)}
    written: list[int] = []
    before: list[int] = []
    n = 0
    for _restart in range(3):
        e = SsdEngine(tmp_path, CAP, SEG, durability)  # type: ignore[arg-type]
        try:
            if written:
                # same keys present as before the close, byte-exact
                assert [i for i in written if e.contains(key(i))] == before
                assert_exact(e, before, sizes)
            for _ in range(250):
                assert e.put(key(n), NS, data(n, sizes[n]))
                written.append(n)
                if n % 5 == 0:  # some reads make records hot, so they are copied forward
                    back = rng.choice(written)
                    got = read(e, back, sizes[back])
                    assert got is None or np.array_equal(got, data(back, sizes[back]))
                n += 1
            st = e.stats()
            assert st["segments_evicted"] > 0 and st["used_bytes"] <= CAP
            before = [i for i in written if e.contains(key(i))]
            assert len(before) == len(e) > 0
        finally:
            e.close()
    assert sorted(p.stat().st_size for p in tmp_path.glob("seg-*.kvs")) == [SEG] * SEGS


# ---------------------------------------------------------------------------- threads
@pytest.mark.slow
def test_concurrent_put_get_on_a_tiny_ssd(tmp_path: Path) -> None:
    seg = 512 << 10  # 7 records a segment, 28 in the log: constant eviction
    e = SsdEngine(tmp_path, 4 * seg, seg, "cache", io_threads=4)
    universe = 96
    expected = {i: data(i) for i in range(universe)}
    errors: list[BaseException] = []
    counts = {"hits": 0, "puts": 0, "gets": 0}
    stop = time.monotonic() + 3.0
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        hits = puts = gets = 0
        try:
            while time.monotonic() < stop:
                op = rng.random()
                if op < 0.45:
                    i = rng.randrange(universe)
                    assert e.put(key(i), NS, expected[i])
                    puts += 1
                elif op < 0.85:
                    i = rng.randrange(universe)
                    out = np.zeros(CHUNK, dtype=np.uint8)
                    gets += 1
                    if e.get_into(key(i), out):
                        hits += 1
                        assert np.array_equal(out, expected[i]), f"wrong bytes for {i}"
                else:
                    picks = rng.sample(range(universe), 3)
                    outs = [np.zeros(CHUNK, dtype=np.uint8) for _ in picks]
                    gets += 3
                    for i, out, ok in zip(picks, outs, e.get_many_into(
                            [key(i) for i in picks], outs), strict=True):
                        if ok:
                            hits += 1
                            assert np.array_equal(out, expected[i]), f"wrong bytes for {i}"
        except BaseException as exc:
            errors.append(exc)
        with lock:
            counts["hits"] += hits
            counts["puts"] += puts
            counts["gets"] += gets

    try:
        run_threads(worker, 4, errors)
        st = e.stats()
        assert counts["hits"] > 0 and st["segments_evicted"] > 0
        assert st["puts"] == counts["puts"] and st["gets"] == counts["gets"]
        assert st["used_bytes"] <= 4 * seg and st["records"] <= 28
        # quiescent now: everything the index holds must read back exactly
        present = [i for i in range(universe) if e.contains(key(i))]
        assert len(present) == len(e)
        for i in present:
            assert np.array_equal(read(e, i), expected[i]), f"record {i} unreadable"
    finally:
        e.close()
    e = SsdEngine(tmp_path, 4 * seg, seg, "cache")
    try:
        assert [i for i in range(universe) if e.contains(key(i))] == present
        assert_exact(e, present)
    finally:
        e.close()


@pytest.mark.slow
def test_concurrent_writers_leave_no_phantom_index_entries(tmp_path: Path) -> None:
    """Writers racing round a minimal log (2 segments of 2 records): once quiet, every key the
    index holds must read back, and the index can never hold more records than the log.

    Race: a writer decrements its segment's ``inflight`` and drops the lock, then takes it
    again to index its records; in between, other writers can wrap the log and recycle that
    segment, so the records are indexed at locations that now belong to the segment's next
    life (phantoms: present to contains/len/lookup, every read a stale miss)."""
    seg = 6 * 4096  # header block + 2 records of 8 KiB (+ 1 spare block)
    payload = 4096
    deadline = time.monotonic() + 4.0
    trial = 0
    while time.monotonic() < deadline:
        trial += 1
        path = tmp_path / f"t{trial}"
        e = SsdEngine(path, 2 * seg, seg, "cache", io_threads=2)
        written: list[list[bytes]] = [[] for _ in range(8)]
        errors: list[BaseException] = []
        stop = time.monotonic() + 0.3

        def writer(t: int, e: SsdEngine = e, written: list[list[bytes]] = written,
                   errors: list[BaseException] = errors, stop: float = stop) -> None:
            try:
                i = 0
                while time.monotonic() < stop:
                    k = key(i, salt=b"phantom" + bytes([t]))
                    assert e.put(k, NS, np.full(payload, t, dtype=np.uint8))
                    written[t].append(k)
                    i += 1
            except BaseException as exc:
                errors.append(exc)

        try:
            run_threads(writer, 8, errors)
            phantoms = []
            for t, keys in enumerate(written):
                for k in keys:
                    out = np.zeros(payload, dtype=np.uint8)
                    if e.contains(k) and not e.get_into(k, out):
                        phantoms.append(k.hex())
                    elif e.contains(k):
                        assert np.all(out == t)
            assert not phantoms, f"trial {trial}: indexed but unreadable: {phantoms}"
            assert len(e) <= 4, f"trial {trial}: {len(e)} records indexed in a 4-record log"
        finally:
            e.close()


# ---------------------------------------------------------------------------- tombstones
def test_delete_and_invalidate_persist_across_restarts(tmp_path: Path) -> None:
    ns_a = NS
    ns_b = Namespace("other-model", KVLayout("uint8", 1, 1, 65536, 1, kv_factor=1))
    a = list(range(0, 10))
    b_old = list(range(100, 110))
    b_new = list(range(200, 205))
    e = SsdEngine(tmp_path, 16 * MiB, SEG, "durable")
    try:
        for i in a:
            assert e.put(key(i), ns_a, data(i))
        for i in b_old:
            assert e.put(key(i), ns_b, data(i))
        assert e.delete(key(3)) is True
        assert e.delete(key(3)) is False
        assert e.delete(key(999)) is False
        assert e.invalidate(ns_b.id) == 10
        assert e.invalidate(Namespace("never-used", ns_a.layout).id) == 0
        for i in b_new:
            assert e.put(key(i), ns_b, data(i))
        assert e.put(key(102), ns_b, data(102))  # a key of ns_b written again afterwards
        assert e.stats()["deletes"] == 1
    finally:
        e.close()
    live = [i for i in a if i != 3] + [102, *b_new]
    gone = [3] + [i for i in b_old if i != 102]
    for _restart in range(2):
        e = SsdEngine(tmp_path, 16 * MiB, SEG, "durable")
        try:
            assert len(e) == len(live)
            assert_exact(e, live)
            for i in gone:
                assert not e.contains(key(i))
                assert read(e, i) is None
            assert e.stats()["checksum_failures"] == 0
        finally:
            e.close()
    # a deleted key written again after the restart stays
    e = SsdEngine(tmp_path, 16 * MiB, SEG, "durable")
    try:
        assert e.put(key(3), ns_a, data(3))
        assert e.invalidate(ns_b.id) == 6
    finally:
        e.close()
    e = SsdEngine(tmp_path, 16 * MiB, SEG, "durable")
    try:
        assert_exact(e, [*a])
        assert len(e) == len(a)
        for i in [*b_old, *b_new]:
            assert not e.contains(key(i))
    finally:
        e.close()
