"""``KVPool.pin_many(fetch=True)``: chunks only the SSD holds are read once, straight into
DRAM slots, and pinned there (the load's read is the promotion)."""

from pathlib import Path

import numpy as np
from kvtest import byte_namespace, payload_for, small_config

from kvpool import KVPool


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_fetching_pins_reads_each_ssd_chunk_once_into_dram(tmp_path: Path) -> None:
    ns, keys = byte_namespace(), [k(i) for i in range(6)]
    cfg = small_config(tmp_path)
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
    cfg = small_config(tmp_path, dram={"put_wait_s": 60.0})  # a wait would hang the test
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
