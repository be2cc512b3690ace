"""What a pool's close keeps (issue 11 item 6): by default every put reaches the SSD, and in
``ssd_write: evict`` mode close writes what only DRAM holds, within ``pool.close_drain_s``."""

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvtest import byte_namespace, payload_for, small_config

from kvpool import KVPool
from kvpool.keys import Namespace


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def on_ssd_after_reopen(cfg: Any, ns: Namespace, keys: list[bytes]) -> list[bytes]:
    """The keys an SSD-only pool over the same directory returns, each checked byte for
    byte against what was put."""
    ssd_only = cfg.model_copy(update={"dram": cfg.dram.model_copy(update={"capacity": 0})})
    found = []
    with KVPool(ssd_only) as pool:
        pool.register_namespace(ns)
        out = np.zeros(ns.chunk_bytes, np.uint8)
        for key in keys:
            if pool.get_into(ns, key, out):
                assert np.array_equal(out, payload_for(key))
                found.append(key)
    return found


def put_and_close(cfg: Any, ns: Namespace, keys: list[bytes],
                  delete: list[bytes]) -> dict[str, Any]:
    with KVPool(cfg) as pool:
        pool.register_namespace(ns)
        assert pool.put_many(ns, keys, [payload_for(x) for x in keys]) == len(keys)
        for key in delete:
            assert pool.delete(ns, key)
        stats = pool.stats()
    return stats


def test_the_default_config_keeps_every_put_over_a_restart(tmp_path: Path) -> None:
    ns, keys = byte_namespace(), [k(i) for i in range(8)]  # DRAM holds 16: nothing evicted
    cfg = small_config(tmp_path)
    assert cfg.pool.ssd_write == "through"
    put_and_close(cfg, ns, keys, delete=[keys[2]])
    assert on_ssd_after_reopen(cfg, ns, keys) == keys[:2] + keys[3:]


@pytest.mark.parametrize("drain_s", [10.0, 0.0])
def test_evict_mode_close_writes_what_only_dram_holds(tmp_path: Path, drain_s: float) -> None:
    ns, keys = byte_namespace(), [k(i) for i in range(12)]
    cfg = small_config(tmp_path, pool={"ssd_write": "evict", "close_drain_s": drain_s})
    stats = put_and_close(cfg, ns, keys, delete=[keys[5]])
    assert stats["dram"]["evictions"] == 0 and stats["ssd"]["records"] == 0  # DRAM-only
    kept = keys[:5] + keys[6:]
    assert on_ssd_after_reopen(cfg, ns, keys) == (kept if drain_s else [])


def test_evict_mode_close_skips_chunks_the_ssd_already_holds(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A chunk promoted from SSD into DRAM is not offered to the SSD again at close."""
    ns, keys = byte_namespace(), [k(i) for i in range(4)]
    cfg = small_config(tmp_path, pool={"ssd_write": "evict"})
    with caplog.at_level(logging.INFO, logger="kvpool.tiers.stack"):
        put_and_close(cfg, ns, keys, delete=[])
        assert "wrote 4 DRAM-only chunks to SSD, 0 left behind" in caplog.text
        caplog.clear()
        with KVPool(cfg) as pool:  # the reads promote all four into DRAM
            pool.register_namespace(ns)
            out = np.zeros(ns.chunk_bytes, np.uint8)
            assert all(pool.get_into(ns, key, out) for key in keys)
            pool.flush()
            assert pool.stats()["dram"]["entries"] == 4
        assert "DRAM-only" not in caplog.text
    assert on_ssd_after_reopen(cfg, ns, keys) == keys
