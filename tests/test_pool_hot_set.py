"""A hot set served from DRAM keeps its SSD records: DRAM hits count as reads of them for the
SSD's second_chance eviction, a DRAM victim whose SSD record was evicted meanwhile is written
back, and close writes what the SSD lacks; so a restart, which empties DRAM, keeps the hot
set. Hot records the copy-forward cap drops are counted.

Geometry: 16 KiB chunks (a record is 20 KiB), SSD of 4 segments of 1 MiB (about 50 records a
segment, 200 in all), DRAM of 2 MiB (128 chunks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvtest import byte_namespace, payload_for, small_config
from metrics_support import scrape, value

from kvpool import KVPool
from kvpool.config import Config
from kvpool.keys import Namespace
from kvpool.ssd.engine import SsdEngine
from kvpool.tiers.dram import PinnedView

C = 16 * 1024
NS = byte_namespace(C)
HOT = 40
ROUNDS = 100  # 8 cold chunks a round: 800 in all, the SSD log turned over 4 times


def key(i: int, tag: bytes) -> bytes:
    return tag * 8 + i.to_bytes(8, "little")


def config(tmp_path: Path, **pool: Any) -> Config:
    return small_config(tmp_path, dram={"capacity": "2MiB", "slab_size": "256KiB"},
                        ssd={"capacity": "4MiB", "segment_size": "1MiB"}, pool=pool)


def exact(pool: KVPool, ns: Namespace, keys: list[bytes]) -> int:
    """How many of ``keys`` read back with their exact bytes."""
    out = np.zeros(ns.chunk_bytes, np.uint8)
    return sum(pool.get_into(ns, k, out) and np.array_equal(out, payload_for(k, ns.chunk_bytes))
               for k in keys)


def put(pool: KVPool, keys: list[bytes]) -> None:
    assert pool.put_many(NS, keys, [payload_for(k, C) for k in keys]) == len(keys)


def read_from_dram(pool: KVPool, keys: list[bytes], pin: bool) -> None:
    """One read of every key, as an engine (pin_many) or a storage node's GET
    (get_many_into) does it."""
    if pin:
        for view in pool.pin_many(NS, keys, fetch=True):
            if view is not None:
                view.release()
    else:
        pool.get_many_into(NS, keys, [np.zeros(C, np.uint8) for _ in keys])


@pytest.mark.parametrize(("ssd_write", "pin"), [("through", False), ("through", True),
                                                ("evict", False)])
def test_a_hot_set_served_from_dram_survives_the_ssd_turning_over_and_a_restart(
        tmp_path: Path, ssd_write: str, pin: bool) -> None:
    """The hot set is put a few chunks at a time among cold ones (at most ~10 hot records a
    segment: under ssd.copy_forward_fraction = 0.25) and read every round, from DRAM, while
    800 cold chunks go through. On main DRAM hits never reached the SSD: in through mode 0
    of 40 hot chunks were on the SSD at the end; in evict mode 32 of 40 were readable after
    the restart."""
    cfg = config(tmp_path, ssd_write=ssd_write)
    hot = [key(i, b"h") for i in range(HOT)]
    with KVPool(cfg) as pool:
        pool.register_namespace(NS)
        cold = reads = 0
        for r in range(ROUNDS):
            put(pool, hot[2 * r:2 * r + 2])  # the first 20 rounds bring the hot set in
            put(pool, [key(cold + j, b"c") for j in range(8)])
            cold += 8
            read_from_dram(pool, hot[:2 * r + 2], pin)
            reads += len(hot[:2 * r + 2])
            assert pool.flush(30)
        stats = pool.stats()
        assert stats["ssd"]["segments_evicted"] >= 8  # the log turned over twice and more
        assert stats["pool"]["dram_hits"] >= 0.8 * reads  # DRAM served them
        assert stats["ssd"].get("hot_dropped", 0) == 0
        if ssd_write == "through":  # (evict: DRAM-only until evicted or closed, by design)
            # what a kill -9 would keep: the SSD's own copies
            engine: SsdEngine = pool._stack.ssd.engine  # type: ignore[union-attr]
            on_ssd = sum(engine.contains_many(hot, NS.id))
            assert on_ssd >= 0.95 * HOT, f"{on_ssd} of {HOT} hot chunks on the SSD"
    with KVPool(cfg) as pool:  # restarted: DRAM is empty
        pool.register_namespace(NS)
        survived = exact(pool, NS, hot)
    assert survived >= 0.95 * HOT, f"{survived} of {HOT} hot chunks after the restart"


def test_hot_records_over_the_copy_forward_cap_are_counted_and_exported(
        tmp_path: Path) -> None:
    """20 records of the oldest segment are read from DRAM (note_reads: no SSD read), but
    the cap lets 5 of them be copied forward (ssd.copy_forward_fraction = 0.1 of a 1 MiB
    segment: 25 blocks, 5 records of 5 blocks): 15 are counted as hot and dropped, in the
    engine's stats and as kvpool_ssd_hot_dropped_total."""
    cfg = small_config(tmp_path, dram={"capacity": 0},
                       ssd={"capacity": "4MiB", "segment_size": "1MiB",
                            "copy_forward_fraction": 0.1})
    with KVPool(cfg, serve_metrics=False) as pool:
        pool.register_namespace(NS)
        engine: SsdEngine = pool._stack.ssd.engine  # type: ignore[union-attr]
        first = [key(i, b"f") for i in range(20)]
        put(pool, first)
        assert pool.flush(30)
        engine.note_reads(first)  # as the pool does for DRAM hits
        n = 0
        while engine.stats()["segments_evicted"] == 0:
            put(pool, [key(n + j, b"c") for j in range(8)])
            n += 8
            assert pool.flush(30)
        st = engine.stats()
        assert st["copied_forward"] == 5 and st["hot_dropped"] == 15
        assert sum(engine.contains_many(first, NS.id)) == 5
        assert value(scrape(pool.metrics), "kvpool_ssd_hot_dropped_total") == 15


def pinned_while_the_ssd_turns_over(pool: KVPool, ns: Namespace, x: bytes) -> PinnedView:
    """Put ``x`` and flush it, pin it in DRAM by the tier itself (not a pool read, so its SSD
    record stays cold), then put 120 cold chunks in flushed batches of 8, which turn the small
    SSD log over. Returns the pin; the caller releases it."""
    assert pool.put(ns, x, payload_for(x, ns.chunk_bytes)) and pool.flush(30)
    held = pool._front.view(x)  # type: ignore[union-attr]
    assert held is not None
    for i in range(0, 120, 8):
        cold = [key(i + j, b"c") for j in range(8)]
        assert pool.put_many(ns, cold, [payload_for(k, ns.chunk_bytes) for k in cold]) == 8
        assert pool.flush(30)
    return held


def test_a_dram_victim_whose_ssd_record_was_evicted_is_written_back(tmp_path: Path) -> None:
    """A chunk written through to the SSD stays in DRAM (pinned, never read through the pool)
    while the SSD log turns over twice: its SSD record is gone. When DRAM
    evicts it, it is written back (on main it was marked as held below and dropped), and a
    restart finds it."""
    cfg = small_config(tmp_path, dram={"capacity": "1MiB", "slab_size": "256KiB",
                                       "eviction": "lru"},
                       ssd={"capacity": "4MiB", "segment_size": "1MiB",
                            "copy_forward_fraction": 0.0})
    ns = byte_namespace()  # 64 KiB chunks: DRAM holds 16, the SSD 56
    x = key(0, b"x")
    with KVPool(cfg) as pool:
        pool.register_namespace(ns)
        engine: SsdEngine = pool._stack.ssd.engine  # type: ignore[union-attr]
        held = pinned_while_the_ssd_turns_over(pool, ns, x)
        assert not engine.contains(x, ns.id)  # evicted from the SSD while DRAM held it
        held.release()
        cold = [key(200, b"c")]  # least recently used now: DRAM evicts it for this one
        assert pool.put_many(ns, cold, [payload_for(k, ns.chunk_bytes) for k in cold]) == 1
        assert pool.flush(30)
        assert not pool._front.contains(x)  # type: ignore[union-attr]
        assert pool.stats()["pool"].get("written_back", 0) == 1
        assert engine.contains(x, ns.id)
        assert value(scrape(pool.metrics), "kvpool_ssd_written_back_total") == 1
    with KVPool(cfg) as pool:
        pool.register_namespace(ns)
        assert exact(pool, ns, [x]) == 1


def test_hot_records_the_cap_drops_are_written_back_from_dram(tmp_path: Path) -> None:
    """A hot set put in one batch fills 80% of a segment, over ssd.copy_forward_fraction
    (0.25): each eviction of its segment copies a quarter forward and drops the rest
    (counted), and the pool writes those back from DRAM through the write-behind queue at
    once, so the SSD keeps the whole hot set (what a kill -9 keeps) while the log turns over
    4 times. Kept on the SSD at the end: 40 of 40; with the write-back off 12 (0.25), 25
    (0.5), 40 (0.9, the same write amplification as the write-back); on main 0."""
    cfg = config(tmp_path)
    hot = [key(i, b"h") for i in range(HOT)]
    with KVPool(cfg) as pool:
        pool.register_namespace(NS)
        put(pool, hot)
        for r in range(ROUNDS):
            put(pool, [key(8 * r + j, b"c") for j in range(8)])
            read_from_dram(pool, hot, pin=False)
            assert pool.flush(30)
        stats = pool.stats()
        assert stats["ssd"]["segments_evicted"] >= 12
        assert stats["ssd"].get("hot_dropped", 0) > 0
        assert stats["pool"].get("written_back", 0) > 0
        engine: SsdEngine = pool._stack.ssd.engine  # type: ignore[union-attr]
        on_ssd = sum(engine.contains_many(hot, NS.id))
        assert on_ssd >= 0.95 * HOT, f"{on_ssd} of {HOT} hot chunks on the SSD"


def test_close_writes_dram_chunks_the_ssd_evicted_in_through_mode(tmp_path: Path) -> None:
    """Written through, then evicted from the SSD's log while DRAM held it: close writes it
    to the SSD (pool.close_drain_s), as it writes DRAM-only chunks in evict mode; on main a
    through-mode close wrote nothing and the restart lost it."""
    cfg = small_config(tmp_path, dram={"capacity": "1MiB", "slab_size": "256KiB"},
                       ssd={"capacity": "4MiB", "segment_size": "1MiB",
                            "copy_forward_fraction": 0.0}, pool={"ssd_write": "through"})
    ns = byte_namespace()
    x = key(0, b"x")
    with KVPool(cfg) as pool:
        pool.register_namespace(ns)
        held = pinned_while_the_ssd_turns_over(pool, ns, x)
        held.release()
        assert not pool._stack.ssd.engine.contains(x, ns.id)  # type: ignore[union-attr]
    with KVPool(cfg) as pool:
        pool.register_namespace(ns)
        assert exact(pool, ns, [x]) == 1


def test_a_touch_that_finds_the_engine_busy_is_queued_not_skipped(tmp_path: Path) -> None:
    """A replica's TOUCH (pool.touch, on a node's event loop) never waits for the SSD
    engine's lock: while another thread holds it the mark is queued (touch_deferred) and
    applied before the next eviction, so the record is still copied forward. On main it was
    skipped (touch_skipped) and the record dropped with its segment."""
    engine = SsdEngine(tmp_path, 4 << 20, 1 << 20, "cache", eviction="second_chance")
    try:
        first = [key(i, b"f") for i in range(4)]
        assert engine.put_many([(k, NS, payload_for(k, C)) for k in first]) == 4
        with engine._lock:  # another thread's lock hold, as the touch sees it
            touched = [engine.touch(k) for k in first[:2]]
        assert touched == [False, False]
        n = 0
        while engine.stats()["segments_evicted"] == 0:
            cold = [key(n + j, b"c") for j in range(8)]
            assert engine.put_many([(k, NS, payload_for(k, C)) for k in cold]) == 8
            n += 8
        assert engine.contains_many(first, NS.id) == [True, True, False, False]
        assert engine.stats()["touch_deferred"] == 2
        out = np.zeros(C, np.uint8)
        assert engine.get_into(first[0], out) and np.array_equal(out, payload_for(first[0], C))
    finally:
        engine.close()


def test_read_marks_are_deduplicated_and_bounded() -> None:
    from kvpool.ssd.recency import ReadMarks  # here: the other tests also run against main

    marks = ReadMarks(batch=4, limit=6)
    assert not marks.add([b"a" * 16, b"b" * 16, b"a" * 16])
    assert marks.add([b"c" * 16])  # 4 queued: a batch is due
    assert marks.take(3) == [b"a" * 16, b"b" * 16]  # the first 3, deduplicated
    assert len(marks) == 1
    marks.add([bytes([i]) * 16 for i in range(8)])  # 9 > 6: the 3 oldest dropped
    assert len(marks) == 6 and marks.dropped == 3
    assert marks.take() == [bytes([i]) * 16 for i in range(2, 8)] and len(marks) == 0
