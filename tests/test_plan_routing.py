"""kvpool plan --engines: the routing simulation on hand-made and shared traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.cli import main
from kvpool.plan import cost
from kvpool.plan.routing import RoutingSettings, run
from kvpool.plan.trace import read_trace

TRACE = Path("/work/shared/traces/conversation_head.jsonl")


def _conversations(path: Path, conversations: int, turns: int) -> Path:
    """Interleaved conversations: turn t of conversation c extends its turn t-1 by 2 blocks,
    all share block 0 (a system prompt); one request every 100 ms."""
    rows = []
    for t in range(turns):
        for c in range(conversations):
            ids = [0] + [1000 * (c + 1) + i for i in range(2 * (t + 1))]
            rows.append({"timestamp": 100 * len(rows), "input_length": 512 * len(ids),
                         "output_length": 20, "hash_ids": ids})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_kv_routing_keeps_conversations_on_their_engine(tmp_path: Path) -> None:
    # 5 conversations over 4 engines: round robin moves each to another engine every turn.
    trace = read_trace(_conversations(tmp_path / "c.jsonl", conversations=5, turns=6))
    costs = cost.CostModel(prefill_s_per_token=1e-5)
    settings = RoutingSettings(engines=4, policies=("kv", "round_robin", "random"),
                               engine_cache_chunks=64, host_pool_chunks=0, storage_chunks=0)
    out = run(trace, settings, costs, chunk_bytes=1 << 20)
    by = {r["policy"]: r for r in out["policies"]}
    kv = by["kv"]
    # Every later turn finds all its earlier blocks (2 per turn) plus block 0 on its engine.
    later = sum(1 + 2 * t for t in range(1, 6)) * 5 * 512
    assert kv["engine_cache_token_hit_rate"] * int(trace.input_tokens.sum()) >= later
    assert kv["engine_cache_token_hit_rate"] > 2 * by["round_robin"]["engine_cache_token_hit_rate"]
    # The load term spreads the conversations: no engine takes more than two of the five.
    assert sum(kv["requests_per_engine"]) == 30 and max(kv["requests_per_engine"]) <= 12
    assert out["routing_kv_vs_round_robin_ttft_p50"] < 1.0
    assert kv["load_max_vs_mean"] == pytest.approx(out["routing_kv_load_max_vs_mean"])
    assert kv["decisions"].get("prefix", 0) >= 5 * 5


def test_shared_storage_serves_round_robin_one_tier_lower(tmp_path: Path) -> None:
    trace = read_trace(_conversations(tmp_path / "c.jsonl", conversations=3, turns=4))
    settings = RoutingSettings(engines=4, policies=("round_robin",), engine_cache_chunks=64,
                               host_pool_chunks=0, storage_chunks=10_000)
    rr = run(trace, settings, cost.CostModel(), 1 << 20)["policies"][0]
    # Each turn lands on another engine: its earlier blocks come from storage, not the cache.
    assert rr["storage_token_hit_rate"] > rr["engine_cache_token_hit_rate"] > 0


def test_simulation_is_deterministic_and_validates(tmp_path: Path) -> None:
    trace = read_trace(_conversations(tmp_path / "c.jsonl", conversations=3, turns=3))
    settings = RoutingSettings(engines=2, policies=("random", "kv"), engine_cache_chunks=8,
                               host_pool_chunks=8, storage_chunks=8)
    a = run(trace, settings, cost.CostModel(), 4096)
    b = run(trace, settings, cost.CostModel(), 4096)
    for r in a["policies"] + b["policies"]:
        r.pop("elapsed_s")
    assert a == b
    with pytest.raises(ValueError, match="engines"):
        run(trace, RoutingSettings(engines=0), cost.CostModel(), 4096)


@pytest.mark.skipif(not TRACE.exists(), reason="needs /work/shared/traces")
def test_cli_json_on_the_shared_trace(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    rc = main(["plan", "--trace", str(TRACE), "--requests", "600", "--engines", "4",
               "--preset", "gpu-70b", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text(encoding="utf-8"))
    assert [r["policy"] for r in data["policies"]] == ["kv", "round_robin", "random"]
    for key in ("routing_kv_vs_round_robin_ttft_p50", "routing_kv_load_max_vs_mean"):
        assert data[key] > 0
    kv, rr = data["policies"][0], data["policies"][1]
    assert kv["engine_cache_token_hit_rate"] > rr["engine_cache_token_hit_rate"]
    assert len(kv["load_in_flight"]) == 4
    assert main(["plan", "--trace", str(TRACE), "--engines", "0"]) == 2
