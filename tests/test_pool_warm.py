"""Warm start: when a namespace is registered over an existing cache directory (an engine or
a node restarting), the newest SSD chunks of that namespace are moved up into DRAM in the
background, within ``pool.warm_start_fraction`` of the DRAM capacity, so the first hits
after a restart are DRAM hits. Real files, a real second pool over the same directory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from kvtest import CHUNK, byte_namespace, payload_for, small_config
from test_pool import k
from test_pool_prefetch import in_dram

from kvpool import KVPool
from kvpool.config import Config
from kvpool.keys import Namespace
from kvpool.ssd.engine import SsdEngine

N = 24  # chunks of 64 KiB: DRAM (1 MiB) holds 16, the default fraction 0.5 warms 8


def saved(tmp_path: Path, ns: Namespace, keys: list[bytes], **pool: object) -> Config:
    """Put ``keys`` in two batches through one pool and close it; the config for the next."""
    cfg = small_config(tmp_path, pool=dict(pool))
    with KVPool(cfg) as first:
        first.register_namespace(ns)
        half = len(keys) // 2
        for batch in (keys[:half], keys[half:]):
            assert first.put_many(ns, batch, [payload_for(x) for x in batch]) == len(batch)
        assert first.flush(10)
    return cfg


def test_a_restart_warms_dram_with_the_newest_chunks_of_the_namespace(tmp_path: Path) -> None:
    ns, keys = byte_namespace(), [k(i) for i in range(N)]
    cfg = saved(tmp_path, ns, keys)
    with KVPool(cfg) as pool:
        pool.register_namespace(ns)
        assert pool.flush(10)
        st = pool.stats()["pool"]
        assert st["warmed"] == 8 and st["ssd_hits"] == 0  # a warm-up serves no request
        assert in_dram(pool, ns, keys) == [False] * (N - 8) + [True] * 8
        outs = [np.zeros(CHUNK, np.uint8) for _ in range(8)]
        assert pool.get_many_into(ns, keys[-8:], outs) == [True] * 8
        assert pool.stats()["pool"]["dram_hits"] == 8
        for key, out in zip(keys[-8:], outs, strict=True):
            assert np.array_equal(out, payload_for(key))
        pool.register_namespace(ns)  # registering again warms nothing more
        assert pool.flush(10)
        assert pool.stats()["pool"]["warmed"] == 8


@pytest.mark.parametrize("fraction", [0.0, 0.25])
def test_the_fraction_bounds_the_warm_up(tmp_path: Path, fraction: float) -> None:
    ns, keys = byte_namespace(), [k(i) for i in range(N)]
    cfg = saved(tmp_path, ns, keys, warm_start_fraction=fraction)
    with KVPool(cfg) as pool:
        pool.register_namespace(ns)
        assert pool.flush(10)
        warmed = int(fraction * 16)  # of the 16 chunks DRAM holds
        assert pool.stats()["pool"]["warmed"] == warmed
        assert in_dram(pool, ns, keys) == [False] * (N - warmed) + [True] * warmed


def test_only_the_registered_namespace_is_warmed(tmp_path: Path) -> None:
    mine, other = byte_namespace(), byte_namespace(salt="other")
    keys, theirs = [k(i) for i in range(8)], [k(100 + i) for i in range(8)]
    cfg = small_config(tmp_path)
    with KVPool(cfg) as first:
        for ns, batch in ((mine, keys), (other, theirs)):  # the other namespace written last
            first.register_namespace(ns)
            assert first.put_many(ns, batch, [payload_for(x) for x in batch]) == 8
        assert first.flush(10)
    with KVPool(cfg) as pool:
        pool.register_namespace(mine)
        assert pool.flush(10)
        assert in_dram(pool, mine, keys) == [True] * 8
        assert pool.stats()["dram"]["entries"] == 8  # nothing of the other namespace


def test_newest_lists_the_last_written_records_in_write_order(tmp_path: Path) -> None:
    ns, other = byte_namespace(), byte_namespace(salt="other")
    eng = SsdEngine(tmp_path, 4 << 20, 1 << 20)  # ~14 records per segment: 30 span three
    try:
        keys = [k(i) for i in range(30)]
        for start in range(0, 30, 10):
            assert eng.put_many([(x, ns, payload_for(x)) for x in keys[start:start + 10]]) == 10
        assert eng.put(k(999), other, payload_for(k(999)))
        assert eng.delete(keys[-1])
        assert eng.newest(ns.id, 5 * CHUNK) == keys[-6:-1]
        assert eng.newest(ns.id, 5 * CHUNK - 1) == keys[-5:-1]
        assert eng.newest(ns.id, 1 << 30) == keys[:-1]
        assert eng.newest(ns.id, 0) == []
        assert eng.newest(byte_namespace(salt="never").id, 1 << 30) == []
        assert eng.newest(other.id, 1 << 30) == [k(999)]
    finally:
        eng.close()


def test_a_namespace_registered_later_warms_only_free_dram(tmp_path: Path) -> None:
    """A node or engine registering a namespace while another one fills DRAM: the warm-up
    takes only the free slots, never evicting the busy namespace's chunks for old ones."""
    busy, late = byte_namespace(salt="busy"), byte_namespace(salt="late")
    theirs, old = [k(100 + i) for i in range(12)], [k(i) for i in range(N)]
    cfg = saved(tmp_path, late, old)
    with KVPool(cfg) as pool:
        pool.register_namespace(busy)
        assert pool.put_many(busy, theirs, [payload_for(x) for x in theirs]) == 12
        pool.register_namespace(late)  # 4 of DRAM's 16 slots are free; half would be 8
        assert pool.flush(10)
        assert pool.stats()["pool"]["warmed"] == 4
        assert in_dram(pool, busy, theirs) == [True] * 12
        assert in_dram(pool, late, old) == [False] * (N - 4) + [True] * 4
