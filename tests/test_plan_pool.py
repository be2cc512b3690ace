"""The planner agrees with the real thing: its DRAM replay gives the same prefix hits per
request as a DRAM-only ``KVPool`` driven the way the planner models it (lookup, get_many_into
of the hit prefix, put_many of the rest), and its SSD model keeps the same chunks as a real
``SsdEngine`` with the same geometry and segment policy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from kvtest import byte_namespace, small_config
from plan_traces import prefix_tree_requests, write_trace

from kvpool import KVPool
from kvpool.plan.replay import TierConfig, replay
from kvpool.plan.ssd import SsdModel
from kvpool.plan.trace import Trace, read_trace
from kvpool.policy import EVICTION_POLICIES
from kvpool.ssd.engine import SsdEngine

REAL_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "synthetic_trace.jsonl"
CHUNK = 4096
SLAB_CHUNKS = 16  # chunks per DRAM slab (64 KiB slabs): capacities are whole slabs


def _key(k: int) -> bytes:
    return k.to_bytes(16, "little")


def pool_hits(tmp_path: Path, trace: Trace, policy: str, slabs: int) -> list[int]:
    """Prefix chunks per request, from a real DRAM-only KVPool."""
    cfg = small_config(tmp_path, dram={"capacity": slabs * SLAB_CHUNKS * CHUNK,
                                       "slab_size": SLAB_CHUNKS * CHUNK, "eviction": policy,
                                       "prefault": "none"},
                       ssd={"enabled": False})
    ns = byte_namespace(CHUNK)
    data = np.zeros(CHUNK, dtype=np.uint8)
    out = [np.empty(CHUNK, dtype=np.uint8) for _ in range(64)]
    hits: list[int] = []
    starts = trace.starts.tolist()
    with KVPool(cfg, remote=False) as pool:
        pool.register_namespace(ns)
        for j in range(trace.requests):
            keys = [_key(k) for k in trace.keys[starts[j]:starts[j + 1]].tolist()]
            n = pool.lookup(ns, keys)
            got = pool.get_many_into(ns, keys[:n], out[:n])
            assert all(got)
            if keys[n:]:
                assert pool.put_many(ns, keys[n:], [data] * (len(keys) - n)) == len(keys) - n
            hits.append(n)
        assert pool.stats()["dram"]["hits"] == sum(hits)
    return hits


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
def test_planner_matches_a_dram_only_pool(tmp_path: Path, policy: str) -> None:
    trace = read_trace(write_trace(tmp_path / "t.jsonl",
                                   prefix_tree_requests(250, seed=5, max_len=24)))
    slabs = 3  # 48 chunks
    assert trace.distinct > 4 * slabs * SLAB_CHUNKS  # eviction matters
    expected = replay(trace, TierConfig(policy, slabs * SLAB_CHUNKS), CHUNK)
    assert pool_hits(tmp_path, trace, policy, slabs) == expected.hits.tolist()
    assert expected.hits.sum() > 0


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "adaptive", "arc"])
def test_planner_matches_a_pool_on_the_shared_trace(tmp_path: Path, policy: str) -> None:
    if not REAL_TRACE.exists():
        pytest.skip(f"{REAL_TRACE} is absent (shared/traces is not mounted here)")
    trace = read_trace(REAL_TRACE).head(300)
    slabs = max(1, trace.distinct // 4 // SLAB_CHUNKS)  # about 25% of the slice's chunks
    expected = replay(trace, TierConfig(policy, slabs * SLAB_CHUNKS), CHUNK)
    assert pool_hits(tmp_path, trace, policy, slabs) == expected.hits.tolist()


@pytest.mark.parametrize("eviction", ["fifo", "second_chance"])
def test_ssd_model_keeps_what_the_engine_keeps(tmp_path: Path, eviction: str) -> None:
    segment, segments = 64 << 10, 3
    ns = byte_namespace(CHUNK)
    model = SsdModel(eviction, segments, segment, CHUNK)
    rng = np.random.default_rng(7)
    payload = np.zeros(CHUNK, dtype=np.uint8)
    buf = np.empty(CHUNK, dtype=np.uint8)
    engine = SsdEngine(tmp_path / "ssd", segments * segment, segment, direct_io="off",
                       eviction=eviction)
    try:
        for step in range(400):
            k = int(rng.integers(0, 60))
            if k in model and rng.random() < 0.5:
                model.read(k)
                assert engine.get_into(_key(k), buf, namespace_id=ns.id)
            else:
                model.write(k)
                engine.put_many([(_key(k), ns, payload)])
            if step % 50 == 49:
                held = {k for k in range(60) if engine.contains(_key(k))}
                assert held == {k for k in range(60) if k in model}
        assert engine.stats()["copied_forward"] == model.forwarded
    finally:
        engine.close()
    assert model.segments_evicted > 5
