"""Read-ahead along a prefix: ``KVPool.lookup(ns, keys, prefetch=N)`` moves the first N chunks
of the leading run that DRAM lacks up into DRAM in the background (the Mover), so the load
that follows finds them there; bounded by ``pool.prefetch_max_pending``; a chunk removed while
its move is reading is never brought back."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from kvtest import CHUNK, byte_namespace, payload_for, small_config
from test_pool import _HeldReads, k

from kvpool import KVPool
from kvpool.keys import Namespace


def fill(pool: KVPool, ns: Namespace, n: int) -> list[bytes]:
    """``n`` chunks put in order; DRAM (lru, 16 chunks) keeps the last 16, SSD the rest."""
    keys = [k(i) for i in range(n)]
    assert pool.put_many(ns, keys, [payload_for(x) for x in keys]) == n
    assert pool.flush(10)
    return keys


def in_dram(pool: KVPool, ns: Namespace, keys: list[bytes]) -> list[bool]:
    assert pool._front is not None
    return [pool._front.contains(x) for x in keys]


def test_lookup_with_prefetch_lets_the_following_load_hit_dram(tmp_path: Path) -> None:
    ns = byte_namespace()
    with KVPool(small_config(tmp_path, dram={"eviction": "lru"})) as pool:
        pool.register_namespace(ns)
        keys = fill(pool, ns, 24)  # keys[:8] on SSD only
        assert in_dram(pool, ns, keys[:8]) == [False] * 8
        assert pool.lookup(ns, [*keys[:8], k(99)], prefetch=3) == 8
        assert pool.flush(10)
        assert pool.stats()["pool"]["prefetched"] == 3
        assert in_dram(pool, ns, keys[:8]) == [True] * 3 + [False] * 5  # the window only
        before = pool.stats()["pool"]
        outs = [np.zeros(CHUNK, np.uint8) for _ in range(3)]
        assert pool.get_many_into(ns, keys[:3], outs) == [True] * 3
        after = pool.stats()["pool"]
        assert after["dram_hits"] - before["dram_hits"] == 3
        assert after["ssd_hits"] == before["ssd_hits"]
        for key, out in zip(keys, outs, strict=False):
            assert np.array_equal(out, payload_for(key))


def test_the_window_counts_only_chunks_dram_lacks(tmp_path: Path) -> None:
    ns = byte_namespace()
    with KVPool(small_config(tmp_path, dram={"eviction": "lru"})) as pool:
        pool.register_namespace(ns)
        keys = fill(pool, ns, 24)
        run = [keys[20], keys[0], keys[21], keys[1], keys[2]]  # DRAM has keys[20], keys[21]
        assert pool.lookup(ns, run, prefetch=2) == 5
        assert pool.flush(10)
        assert pool.stats()["pool"]["prefetched"] == 2
        assert in_dram(pool, ns, [keys[0], keys[1], keys[2]]) == [True, True, False]


def test_no_prefetch_by_default_and_none_past_the_run(tmp_path: Path) -> None:
    ns = byte_namespace()
    with KVPool(small_config(tmp_path, dram={"eviction": "lru"})) as pool:
        pool.register_namespace(ns)
        keys = fill(pool, ns, 24)
        assert pool.lookup(ns, keys[:8]) == 8
        assert pool.lookup(ns, [k(99), *keys[:8]], prefetch=8) == 0  # no leading run
        assert pool.flush(10)
        assert pool.stats()["pool"]["prefetched"] == 0
        assert in_dram(pool, ns, keys[:8]) == [False] * 8
        with pytest.raises(ValueError, match="prefetch"):
            pool.lookup(ns, keys[:8], prefetch=-1)


def test_prefetch_is_bounded_by_max_pending(tmp_path: Path) -> None:
    ns = byte_namespace()
    cfg = small_config(tmp_path, dram={"eviction": "lru", "put_wait_s": 5.0},
                       pool={"prefetch_max_pending": 1})
    with KVPool(cfg) as pool:
        pool.register_namespace(ns)
        keys = fill(pool, ns, 24)
        pins = [p for p in pool.pin_many(ns, keys) if p is not None]  # every slot pinned
        assert len(pins) == 16
        assert pool.lookup(ns, keys[:4], prefetch=4) == 4  # its move waits for a slot
        assert pool.lookup(ns, keys[4:8], prefetch=4) == 4  # one move queued: skipped
        assert pool.stats()["pool"]["prefetch_skipped"] == 1
        for pin in pins:
            pin.release()
        assert pool.flush(10)
        stats = pool.stats()["pool"]
        assert 1 <= stats["prefetched"] <= 4
        assert not any(in_dram(pool, ns, keys[4:8]))


@pytest.mark.parametrize("removal", ["delete", "invalidate"])
def test_a_chunk_removed_during_its_prefetch_never_comes_back(tmp_path: Path,
                                                               removal: str) -> None:
    ns = byte_namespace()
    with KVPool(small_config(tmp_path, dram={"eviction": "lru"})) as pool:
        pool.register_namespace(ns)
        keys = fill(pool, ns, 20)  # keys[:4] on SSD only
        mover = pool._mover
        assert mover is not None
        held = [_HeldReads(t) for t in mover._lower]
        mover._lower = held  # type: ignore[assignment]
        assert pool.lookup(ns, keys[:1], prefetch=1) == 1  # queues the move
        deadline = time.monotonic() + 10
        while not any(h.read_done.is_set() for h in held) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert any(h.read_done.is_set() for h in held)  # the move has read the chunk...
        if removal == "delete":
            assert pool.delete(ns, keys[0])  # ...and it is removed before it publishes
        else:
            assert pool.invalidate(ns) > 0
        for h in held:
            h.go.set()
        assert pool.flush(10)
        assert in_dram(pool, ns, keys[:1]) == [False]
        assert not pool.get_into(ns, keys[0], np.zeros(CHUNK, np.uint8))
