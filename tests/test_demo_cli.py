"""`kvpool demo` end to end on a small random-weight Llama (the real SmolLM2 path is exercised
by test_models.py and by `make demo`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the hf extra (torch, transformers) is not installed")
pytest.importorskip("matplotlib", reason="the hf extra (matplotlib) is not installed")

from rich.console import Console

from kvpool.cli import main
from kvpool.demo import report
from kvpool.demo.runner import RequestResult


def test_quick_demo_on_a_tiny_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "out"
    rc = main(["demo", "--quick", "--model", "tiny", "--out", str(out), "--json",
               str(out / "r.json"), "--dram", "256MiB", "--ssd", "1GiB"])
    data = json.loads((out / "r.json").read_text())
    assert rc == 0
    assert data["outputs_identical"] is True
    assert set(data["modes"]) == {"recompute", "kvpool", "kvpool-ssd", "file-per-chunk"}
    for key in ("ttft_dram_vs_recompute", "ttft_ssd_vs_recompute", "ttft_vs_file_per_chunk"):
        assert data["ratios"][key] > 0
    assert data["ratios"]["longest_prefix_tokens"] > 0
    assert data["ratios"]["miss_penalty"] > 0 and data["ratios"]["miss_penalty_cold_requests"] > 0
    assert data["ratios"]["miss_overhead_s"] is not None
    kv = data["modes"]["kvpool"]
    assert kv["hit_rate"] > 0.3 and kv["chunk_hits_by_tier"]["dram"] > 0
    assert data["modes"]["kvpool-ssd"]["chunk_hits_by_tier"]["ssd"] > 0
    assert data["modes"]["recompute"]["hit_rate"] == 0
    assert all(m["dropped_saves"] == 0 for m in data["modes"].values())  # every save landed
    requests = [r for r in data["requests"] if r["mode"] == "kvpool"]
    assert {r["name"].split()[0] for r in requests} == {"chat", "doc"}
    assert (out / "ttft.png").stat().st_size > 10_000
    assert not (out / "scratch").exists()


def test_trace_replay_on_a_tiny_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0, "input_length": 2048, "output_length": 5, "hash_ids": [1, 2, 3, 4]},
            {"timestamp": 5, "input_length": 1600, "output_length": 5, "hash_ids": [1, 2, 9, 10]},
            {"timestamp": 9, "input_length": 2048, "output_length": 5, "hash_ids": [1, 2, 3, 4]}]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "out"
    rc = main(["demo", "--quick", "--model", "tiny", "--trace", str(trace), "--out", str(out),
               "--modes", "kvpool", "--dram", "256MiB", "--ssd", "1GiB"])
    data = json.loads((out / "demo.json").read_text())
    assert rc == 0 and data["outputs_identical"] is True
    kv = {r["name"]: r for r in data["requests"] if r["mode"] == "kvpool"}
    cached = [r["cached_tokens"] for r in kv.values()]
    # request 2 shares blocks 1-2 with request 1; request 3 repeats request 1 entirely
    assert cached[0] == 0 and cached[1] == 2 * data["chunk_tokens"] and cached[2] > cached[1]


def _result(mode: str, name: str, cached: int, ttft: float,
            outside_forward: float = 0.0) -> RequestResult:
    return RequestResult(mode=mode, workload="doc", name=name, prompt_tokens=1024,
                         cached_tokens=cached, ttft_s=ttft, total_s=ttft, tokens=[1],
                         forward_s=ttft - outside_forward)


def test_miss_penalty_is_the_median_over_the_cold_requests() -> None:
    # requests a, c, e restore nothing in the kvpool mode (cold); b, d restore their prefix
    rec = [("a", 1.0), ("b", 1.0), ("c", 2.0), ("d", 2.0), ("e", 4.0)]
    kv = [("a", 0, 1.1), ("b", 512, 0.1), ("c", 0, 3.0), ("d", 512, 0.2), ("e", 0, 4.0)]
    # time outside the forward: recompute 0.5 ms each, kvpool 2, 1, 3 ms on a, c, e
    outside = {"a": 0.002, "b": 0.01, "c": 0.001, "d": 0.01, "e": 0.003}
    results = ([_result("recompute", n, 0, t, 0.0005) for n, t in rec]
               + [_result("kvpool", n, c, t, outside[n]) for n, c, t in kv])
    assert report.miss_penalty(results) == (pytest.approx(1.1), 3)  # median of 1.1, 1.5, 1.0
    assert report.miss_overhead_s(results) == pytest.approx(0.0015)  # 1.5, 0.5, 2.5 ms
    ratios = report.headline_ratios(results)
    assert ratios["miss_penalty"] == pytest.approx(1.1)
    assert ratios["miss_penalty_cold_requests"] == 3
    assert ratios["miss_overhead_s"] == pytest.approx(0.0015)
    console = Console(record=True, width=130)
    report.render(report.summarize(results), ratios, console)
    text = console.export_text()
    assert "miss_penalty" in text and f"target {report.MISS_PENALTY_TARGET}" in text
    assert "3 cold requests" in text


def test_no_miss_penalty_without_a_cold_request_or_the_recompute_mode() -> None:
    warm = [_result("recompute", "a", 0, 1.0), _result("kvpool", "a", 512, 0.1)]
    assert report.miss_penalty(warm) is None
    assert "miss_penalty" not in report.headline_ratios(warm)
    assert report.miss_penalty([_result("kvpool", "a", 0, 1.0)]) is None


def test_paired_modes_run_request_by_request(tmp_path: Path) -> None:
    """run_modes replays request k of every mode before request k+1 of any, the first mode
    rotating, every store open from the start; results come back grouped by mode, the same
    tokens in both, and the stores are closed (the scratch directory can be opened again)."""
    import numpy as np
    import torch
    import transformers

    from kvpool.demo.runner import Settings, run_modes
    from kvpool.demo.stores import close_store, make_store
    from kvpool.demo.workloads import Request, RequestList

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(cfg).eval()
    doc = np.random.default_rng(1).integers(0, 512, 100).tolist()
    other = np.random.default_rng(2).integers(0, 512, 70).tolist()
    requests = [Request("doc", "a", doc, 3), Request("doc", "b", [*doc, 5, 6, 7], 3),
                Request("doc", "c", other, 3)]
    settings = Settings(chunk_tokens=16, dram_bytes=64 << 20, ssd_bytes=512 << 20)
    order: list[tuple[str, str]] = []
    results = run_modes(model, ["recompute", "kvpool"], lambda: [RequestList("doc", requests)],
                        tmp_path, settings, "tiny", lambda r: order.append((r.mode, r.name)))
    assert order == [("recompute", "a"), ("kvpool", "a"), ("kvpool", "b"), ("recompute", "b"),
                     ("recompute", "c"), ("kvpool", "c")]
    assert [(r.mode, r.name) for r in results] == [
        ("recompute", "a"), ("recompute", "b"), ("recompute", "c"),
        ("kvpool", "a"), ("kvpool", "b"), ("kvpool", "c")]
    assert [r.tokens for r in results[:3]] == [r.tokens for r in results[3:]]
    assert [r.cached_tokens for r in results[3:]] == [0, 96, 0]
    store = make_store("kvpool", tmp_path, 1 << 20, 64 << 20, 512 << 20)
    close_store(store)


def test_the_ssd_only_mode_stages_two_of_the_largest_requests(tmp_path: Path) -> None:
    """Without DRAM every save waits in the SSD's write-behind queue: at the default 256 MiB a
    6K-token SmolLM2 document (276 MB of KV) had saves dropped."""
    from kvpool.demo.stores import close_store, make_store
    from kvpool.pool import KVPool
    store = make_store("kvpool-ssd", tmp_path, 64 << 10, 0, 1 << 30, request_bytes=400 << 20)
    try:
        assert isinstance(store, KVPool)
        assert store.config.pool.write_behind_bytes == 800 << 20
        assert store.config.dram.capacity == 0
    finally:
        close_store(store)
