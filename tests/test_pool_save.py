"""KVPool.save / begin_save / load / open_load: the pool's own save and load pipeline (one
budget, one set of drop counters, read-your-writes inside the pool)."""

import threading
from pathlib import Path

import numpy as np
import pytest
from kvtest import CHUNK, byte_namespace, payload_for, small_config

from kvpool import KVPool
from kvpool.keys import Namespace


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def filler(keys: list[bytes], calls: list[int] | None = None):  # type: ignore[no-untyped-def]
    def fill(i: int, view: memoryview) -> None:
        if calls is not None:
            calls.append(i)
        np.frombuffer(view, np.uint8)[:] = payload_for(keys[i])
    return fill


def loaded(pool: KVPool, ns: Namespace, keys: list[bytes]) -> tuple[int, list[int]]:
    """load ``keys``; (returned run, indices scattered), each scattered payload checked."""
    seen: list[int] = []

    def scatter(i: int, view: memoryview) -> None:
        assert view.readonly and np.array_equal(np.frombuffer(view, np.uint8),
                                                payload_for(keys[i]))
        seen.append(i)
    return pool.load(ns, keys, scatter), seen


@pytest.mark.parametrize("dram", ["1MiB", "0"])
def test_save_then_load_round_trips_and_counts(tmp_path: Path, dram: str) -> None:
    ns = byte_namespace()
    keys = [k(i) for i in range(6)]
    with KVPool(small_config(tmp_path, dram={"capacity": dram})) as pool:
        pool.register_namespace(ns)
        calls: list[int] = []
        ticket = pool.save(ns, keys, filler(keys, calls))
        assert pool.lookup(ns, keys) == 6  # at once, committed or not
        assert ticket.wait(10) and ticket.stored == 6 and ticket.present == 0
        assert calls == list(range(6))
        assert loaded(pool, ns, keys) == (6, list(range(6)))
        again = pool.save(ns, keys, filler(keys))  # already stored: nothing filled
        assert again.wait(10) and (again.stored, again.present) == (0, 6)
        s = pool.stats()["saves"]
        assert (s["saves"], s["save_chunks"], s["save_stored"], s["save_present"]) == \
            (2, 12, 6, 6)
        assert s["booked_bytes"] == 0


def test_load_reports_the_first_chunk_it_could_not_deliver(tmp_path: Path) -> None:
    ns = byte_namespace()
    keys = [k(i) for i in range(5)]
    with KVPool(small_config(tmp_path)) as pool:
        pool.register_namespace(ns)
        assert pool.save(ns, keys, filler(keys)).wait(10)
        pool.flush()
        assert pool.delete(ns, keys[2])
        assert loaded(pool, ns, keys) == (2, [0, 1])
        with pool.open_load(ns, keys) as handle:  # the chunks after the gap are there too
            assert handle.loaded == 2
            assert [s is not None for s in handle.sources] == [True, True, False, True, True]


def test_chunks_below_dram_load_from_the_ssd(tmp_path: Path) -> None:
    ns = byte_namespace()
    keys = [k(i) for i in range(40)]  # DRAM holds 16
    with KVPool(small_config(tmp_path, pool={"promote_on_hit": False})) as pool:
        pool.register_namespace(ns)
        for start in range(0, 40, 8):
            assert pool.save(ns, keys[start:start + 8], filler(keys[start:start + 8])).wait(10)
            pool.flush()
        assert loaded(pool, ns, keys) == (40, list(range(40)))


def test_a_saved_chunk_is_held_at_once_and_its_load_waits_for_the_commit(
        tmp_path: Path) -> None:
    """Read-your-writes: while the committer is busy (a deferred save whose fill blocks),
    a later save's chunks already count for lookup/contains, and a load of them waits for
    their commit instead of missing."""
    ns = byte_namespace()
    first, second = [k(i) for i in range(2)], [k(i) for i in range(10, 14)]
    release = threading.Event()
    with KVPool(small_config(tmp_path, pool={"save_commit_wait_s": 30})) as pool:
        pool.register_namespace(ns)

        def slow_fill(i: int, view: memoryview) -> None:
            release.wait(30)
            np.frombuffer(view, np.uint8)[:] = payload_for(first[i])

        blocker = pool.save(ns, first, slow_fill, defer=True)
        ticket = pool.save(ns, second, filler(second))
        assert pool.lookup(ns, second) == 4 and pool.contains_many(ns, second) == [True] * 4
        assert not ticket.done()
        timer = threading.Timer(0.3, release.set)
        timer.start()
        assert loaded(pool, ns, second) == (4, [0, 1, 2, 3])  # waited, then hit
        assert ticket.done() and blocker.wait(10) and blocker.stored == 2
        timer.join()
        assert pool.stats()["saves"]["load_commit_waits"] >= 1


def test_a_load_past_the_commit_wait_misses_and_is_counted(tmp_path: Path) -> None:
    ns = byte_namespace()
    first, second = [k(1)], [k(2), k(3)]
    release = threading.Event()
    with KVPool(small_config(tmp_path, pool={"save_commit_wait_s": 0.1})) as pool:
        pool.register_namespace(ns)
        pool.save(ns, first, lambda i, view: release.wait(30), defer=True)
        ticket = pool.save(ns, second, filler(second))
        assert loaded(pool, ns, second) == (0, [])
        assert pool.stats()["saves"]["load_commit_timeouts"] == 1
        release.set()
        assert ticket.wait(10) and ticket.stored == 2
        assert loaded(pool, ns, second) == (2, [0, 1])


def test_the_save_budget_drops_the_tail_and_comes_back(tmp_path: Path) -> None:
    ns = byte_namespace()
    keys = [k(i) for i in range(5)]
    with KVPool(small_config(tmp_path, pool={"save_budget_bytes": 3 * CHUNK})) as pool:
        pool.register_namespace(ns)
        batch = pool.begin_save(ns, keys)
        assert [v is not None for v in batch.views] == [True, True, True, False, False]
        assert pool.begin_save(ns, [k(9)]).views == [None]  # budget used up meanwhile
        batch.abort()
        assert pool.stats()["saves"]["booked_bytes"] == 0
        ticket = pool.save(ns, keys[:3], filler(keys[:3]))
        assert ticket.wait(10) and ticket.stored == 3
        s = pool.stats()["saves"]
        assert (s["save_dropped_budget"], s["save_dropped_aborted"]) == (3, 3)
        assert s["booked_bytes"] == 0


def test_a_failing_fill_gives_the_slots_back_and_raises(tmp_path: Path) -> None:
    ns = byte_namespace()
    keys = [k(i) for i in range(4)]
    with KVPool(small_config(tmp_path)) as pool:
        pool.register_namespace(ns)

        def fill(i: int, view: memoryview) -> None:
            if i == 2:
                raise RuntimeError("engine fault")
            view[:] = payload_for(keys[i]).data

        with pytest.raises(RuntimeError, match="engine fault"):
            pool.save(ns, keys, fill)
        assert pool.lookup(ns, keys) == 0
        deferred = pool.save(ns, keys, fill, defer=True)  # logged, not raised
        assert deferred.wait(10) and deferred.stored == 0 and deferred.taken == [False] * 4
        assert pool.lookup(ns, keys) == 0
        s = pool.stats()["saves"]
        assert s["save_dropped_fill"] == 8 and s["booked_bytes"] == 0
        assert pool.stats()["dram"]["used_bytes"] == 0


def test_flush_and_close_commit_what_was_handed_over(tmp_path: Path) -> None:
    ns = byte_namespace()
    keys = [k(i) for i in range(4)]
    cfg = small_config(tmp_path)
    with KVPool(cfg) as pool:
        pool.register_namespace(ns)
        ticket = pool.save(ns, keys, filler(keys), defer=True)
        assert pool.flush(10) and ticket.done() and ticket.stored == 4
        late = pool.save(ns, [k(7)], filler([k(7)]), defer=True)
    assert late.wait(10) and late.stored == 1
    with KVPool(cfg) as pool:  # written through to the SSD
        pool.register_namespace(ns)
        assert loaded(pool, ns, [*keys, k(7)])[0] == 5


def test_write_through_saves_go_to_the_ssd_from_their_dram_slots(tmp_path: Path) -> None:
    """Cache mode, ssd_write: through: the SSD's queue takes the DRAM slots pinned (no
    staging copy) up to a quarter of DRAM (4 chunks here), copies beyond it; every chunk
    reaches the SSD either way and no pin outlives the write."""
    ns = byte_namespace()
    keys = [k(i) for i in range(10)]
    cfg = small_config(tmp_path)
    with KVPool(cfg) as pool:
        pool.register_namespace(ns)
        assert pool.save(ns, keys[:3], filler(keys[:3])).wait(10)
        assert pool.flush(10)
        wb = pool.stats()["write_behind"]
        assert (wb["offered_pinned"], wb["staging_bytes"], wb["pinned_bytes"]) == (3, 0, 0)
        assert pool.save(ns, keys[3:], filler(keys[3:])).wait(10)
        assert pool.flush(10)
        wb = pool.stats()["write_behind"]
        assert wb["written"] == 10 and wb["pinned_bytes"] == 0 and wb["dropped"] == 0
    with KVPool(small_config(tmp_path, dram={"capacity": 0})) as pool:  # the SSD alone
        pool.register_namespace(ns)
        assert loaded(pool, ns, keys)[0] == 10


def test_save_drops_are_exported_by_cause(tmp_path: Path) -> None:
    from metrics_support import scrape, value
    ns = byte_namespace()
    keys = [k(i) for i in range(5)]
    with KVPool(small_config(tmp_path, pool={"save_budget_bytes": 3 * CHUNK})) as pool:
        pool.register_namespace(ns)
        assert pool.save(ns, keys, filler(keys)).wait(10)
        s = scrape(pool.metrics)
        assert value(s, "kvpool_dropped_saves_total", tier="dram", cause="budget") == 2
        assert value(s, "kvpool_dropped_saves_total", tier="dram", cause="fill_error") == 0
