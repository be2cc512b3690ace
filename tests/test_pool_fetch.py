"""``KVPool.pin_many(fetch=True)``: chunks only the SSD holds are read once, straight into
DRAM slots, and pinned there (the load's read is the promotion)."""

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from kvtest import byte_namespace, payload_for, small_config

from kvpool import KVPool


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_fetching_pins_reads_each_ssd_chunk_once_into_dram(tmp_path: Path) -> None:
    ns, keys = byte_namespace(), [k(i) for i in range(6)]
    cfg = small_config(tmp_path, pool={"warm_start_fraction": 0})  # restarts cold
    with KVPool(cfg) as pool:  # written through to the SSD
        pool.register_namespace(ns)
        pool.put_many(ns, keys, [payload_for(x) for x in keys])
    with KVPool(cfg) as pool:  # a restart: DRAM is empty, the SSD holds all six
        pool.register_namespace(ns)
        assert pool.pin_many(ns, keys[:1]) == [None]  # without fetch: DRAM only
        views = pool.pin_many(ns, [*keys, k(99)], fetch=True)
        assert views[-1] is None
        for key, view in zip(keys, views, strict=False):
            assert view is not None and np.array_equal(np.frombuffer(view.data, np.uint8),
                                                        payload_for(key))
            view.release()
        pool.flush()
        stats = pool.stats()
        assert stats["ssd"]["gets"] == 7 and stats["pool"]["ssd_hits"] == 6  # k(99): a miss
        assert stats["pool"].get("promotions", 0) == 0  # nothing read again behind the load
        again = pool.pin_many(ns, keys)
        assert all(v is not None for v in again)
        for view in again:
            assert view is not None
            view.release()
        assert pool.stats()["ssd"]["gets"] == 7


def test_fetching_pins_without_a_free_slot_gives_none_at_once(tmp_path: Path) -> None:
    ns = byte_namespace()
    cfg = small_config(tmp_path, dram={"put_wait_s": 60.0},  # a wait would hang the test
                       pool={"warm_start_fraction": 0})  # the cold chunks stay on SSD
    held, cold = [k(i) for i in range(16)], [k(100 + i) for i in range(3)]
    with KVPool(cfg) as pool:
        pool.register_namespace(ns)
        pool.put_many(ns, cold, [payload_for(x) for x in cold])
    with KVPool(cfg) as pool:
        pool.register_namespace(ns)
        pool.put_many(ns, held, [payload_for(x) for x in held])  # DRAM holds 16: full
        pins = pool.pin_many(ns, held)
        assert all(p is not None for p in pins)
        assert pool.pin_many(ns, cold, fetch=True) == [None] * 3
        for pin in pins:
            assert pin is not None
            pin.release()
        out = np.zeros(ns.chunk_bytes, np.uint8)
        assert pool.get_into(ns, cold[0], out) and np.array_equal(out, payload_for(cold[0]))


class _CountedHeldReads:
    """Wraps a lower tier of the mover: counts the keys each read asks for and, while
    ``hold`` is set, parks a read that served something until ``go`` (this only controls
    when the background move resumes; the bytes come from the real tier)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.asked: list[bytes] = []
        self.hold, self.read_done, self.go = threading.Event(), threading.Event(), threading.Event()

    def get_many_into(self, ns: Any, keys: Any, outs: Any) -> list[bool]:
        self.asked.extend(keys)
        got = list(self.inner.get_many_into(ns, keys, outs))
        if any(got) and self.hold.is_set():
            self.read_done.set()
            self.go.wait(10)
        return got

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_load_waits_for_the_prefetch_reading_its_chunks_instead_of_reading_them_again(
        tmp_path: Path) -> None:
    ns, keys = byte_namespace(), [k(i) for i in range(4)]
    cfg = small_config(tmp_path, pool={"warm_start_fraction": 0})  # restarts cold
    with KVPool(cfg) as pool:
        pool.register_namespace(ns)
        pool.put_many(ns, keys, [payload_for(x) for x in keys])
    with KVPool(cfg) as pool:  # only the SSD holds them
        pool.register_namespace(ns)
        mover = pool._mover
        assert mover is not None
        tiers = [_CountedHeldReads(t) for t in mover._lower]
        mover._lower = tiers  # type: ignore[assignment]
        for t in tiers:
            t.hold.set()
        assert pool.prefetch(ns, keys) is not None
        deadline = time.monotonic() + 10
        while not any(t.read_done.is_set() for t in tiers) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert any(t.read_done.is_set() for t in tiers)  # the prefetch has read all four
        for t in tiers:
            t.hold.clear()
        result: list[Any] = []
        loader = threading.Thread(target=lambda: result.append(
            pool.pin_many(ns, keys, fetch=True)))
        loader.start()
        # a load that read the chunks itself would be done (and have asked again) by now
        deadline = time.monotonic() + 2
        while loader.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loader.is_alive() and all(len(t.asked) == len(keys) for t in tiers)
        for t in tiers:
            t.go.set()
        loader.join(30)
        views = result[0]
        assert all(v is not None for v in views)
        for key, view in zip(keys, views, strict=True):
            assert np.array_equal(np.frombuffer(view.data, np.uint8), payload_for(key))
            view.release()
        for t in tiers:  # each tier was asked for each chunk once: by the prefetch
            assert sorted(t.asked) == sorted(keys)
