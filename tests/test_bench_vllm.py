"""`kvpool bench vllm` labels its engine with what each run reported (run_engine's ``engine``),
not a constant. The engine runs are replaced at ``_run`` (a real one needs the vLLM venv and
minutes; tests/vllm check that run_engine reports ``engine``). The ratios are computed and
printed from a fabricated result."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool.bench import vllm as bench
from kvpool.integrations.models import smollm2


@pytest.fixture
def fake_engines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The bench's engine runs, its host pool and its model replaced by fakes (SmolLM2 at
    ``tmp_path / "model"``); returns the list of engine specs run, in order."""
    ran: list[dict[str, Any]] = []

    def fake_run(python: str, spec: dict[str, Any], work: Path, name: str,
                 env: dict[str, str] | None = None) -> dict[str, Any]:
        ran.append(spec)
        return {"outputs": [{"wall_s": 0.5 if name == "recompute" else 0.1,
                             "token_ids": [len(p)]} for p in spec["prompts"]],
                "connector_stats": None,
                "engine": {"vllm_version": "9.8.7", "device": "cpu", "dtype": "float32",
                           "enforce_eager": True, "model": spec["model"]}}

    class NoHost:  # the host cases' kvpool host: its engines are fakes too
        def stop(self) -> int:
            return 0

    monkeypatch.setattr(bench, "_run", fake_run)
    monkeypatch.setattr(bench, "_host_pool", lambda work: NoHost())
    monkeypatch.setattr(bench, "vllm_python", lambda: "python")
    monkeypatch.setattr(smollm2, "smollm2_hf_dir", lambda: tmp_path / "model")
    return ran


def test_the_engine_label_is_what_ran(tmp_path: Path,
                                      fake_engines: list[dict[str, Any]]) -> None:
    ran = fake_engines
    report = bench.run_vllm_bench(quick=True, repeats=1, work=tmp_path)
    # every mode, then the cross-instance case's recompute and engines A and B, in float32
    # (no TP=2 with --quick)
    assert len(ran) == len(bench.MODES) + len(bench.SECOND_ROUND) + 3
    # the second round: the same specs again, after the first round's
    rounds = len(bench.MODES) + len(bench.SECOND_ROUND)
    assert ran[len(bench.MODES):rounds] == [ran[bench.MODES.index(m)]
                                            for m in bench.SECOND_ROUND]
    assert ran[-3]["connector"] is None and ran[-3]["prompts"] == ran[-1]["prompts"]
    assert [s["connector"]["extra"]["config"]["host"] for s in ran[-2:]] == \
        [{"socket": str(tmp_path / "cross_instance" / "host" / "host.sock")}] * 2
    assert [s.get("dtype") for s in ran[-3:]] == ["float32"] * 3
    assert all("dtype" not in s for s in ran[:-3])
    # the hit modes run more requests per document, the recompute mode's prompts first
    recompute, hit_modes = ran[0], ran[1:len(bench.MODES)]
    per_doc, hit_per_doc = 2, bench.HIT_REPEATS_FACTOR + 1
    assert len(recompute["prompts"]) == 2 * per_doc  # two documents with --quick
    for spec in hit_modes:
        assert len(spec["prompts"]) == 2 * hit_per_doc
        assert spec["prompts"][:per_doc] == recompute["prompts"][:per_doc]
        assert spec["prompts"][hit_per_doc:hit_per_doc + per_doc] == \
            recompute["prompts"][per_doc:]
    assert report["hit_repeats"] == bench.HIT_REPEATS_FACTOR
    for mode in bench.MODES:  # the second round's hits pooled with the first's
        runs = 2 if mode in bench.SECOND_ROUND else 1
        assert report["modes"][mode]["runs"] == runs
        samples = report["modes"][mode]["ttft"]["1024"]["samples_s"]
        assert len(samples) == runs * (1 if mode == "recompute" else bench.HIT_REPEATS_FACTOR)
    assert report["engine"] == "vllm 9.8.7 on cpu (float32, eager)"
    assert report["modes"]["kvpool"]["engine"]["model"] == str(tmp_path / "model")
    assert report["ratios"]["ttft_hit_vs_recompute"] == pytest.approx(0.2)
    assert report["ratios"]["cross_instance_ttft_hit_vs_recompute"] == pytest.approx(0.2)
    assert report["ratios"]["cross_instance_outputs_identical"] == 1.0
    assert "tp2_ttft_hit_vs_recompute" not in report["ratios"]


def test_the_tp2_case_runs_a_model_whose_heads_split_over_two_ranks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        fake_engines: list[dict[str, Any]]) -> None:
    """SmolLM2-135M's 9 heads cannot be split over TP=2 (vLLM refuses it: a full run used to
    fail there, losing every figure measured before). The TP=2 engines get TP2_MODEL, with
    every prompt's token ids inside its vocabulary and the documents' shared prefixes kept."""
    ran = fake_engines
    built: list[Path] = []
    monkeypatch.setattr(bench, "tp2_model", lambda path: built.append(path) or path)
    bench.run_vllm_bench(quick=False, repeats=1, work=tmp_path)
    tp2 = [s for s in ran if s.get("tensor_parallel_size") == 2]
    assert len(tp2) == 3  # recompute, A, B
    assert built == [tmp_path / "tp2-model"]
    assert {s["model"] for s in tp2} == {str(tmp_path / "tp2-model")}
    assert _splits_over_two_ranks(bench.TP2_MODEL)
    vocab = bench.TP2_MODEL["vocab_size"]
    recompute, a, b = tp2
    assert all(0 <= t < vocab for s in tp2 for p in s["prompts"] for t in p)
    assert len(b["prompts"]) == len(ran[0]["prompts"]) and recompute["prompts"] == b["prompts"]
    assert a["prompts"] == b["prompts"][::2]  # each document's first request (per_doc = 2)
    assert b["prompts"][0][:1024] == b["prompts"][1][:1024]  # one document, two questions
    assert all(s["model"] == str(tmp_path / "model") for s in ran if s not in tp2)


def _splits_over_two_ranks(model: dict[str, int]) -> bool:
    return model["num_heads"] % 2 == 0 and model["num_kv_heads"] % 2 == 0


def test_engine_label_names_compiled_runs() -> None:
    info = {"vllm_version": "0.32.0", "device": "cuda", "dtype": "bfloat16",
            "enforce_eager": False}
    assert bench.engine_label(info) == "vllm 0.32.0 on cuda (bfloat16, compiled)"


def _mode(rows: dict[int, tuple[float, list[float]]]) -> dict[str, Any]:
    """A mode as run_vllm_bench builds it: per length (first request, timed samples)."""
    return {"ttft": {str(n): {"first_request_s": first, "samples_s": samples,
                              "median_s": float(np.median(samples)),
                              "p99_s": float(np.percentile(samples, 99))}
                     for n, (first, samples) in rows.items()}}


def test_ratios_pool_the_hits_and_compare_the_first_requests() -> None:
    modes = {"recompute": _mode({1024: (0.5, [0.4, 0.4]), 6144: (2.0, [2.0, 2.0])}),
             "kvpool": _mode({1024: (0.6, [0.1, 0.1, 0.1]), 6144: (0.2, [0.2, 0.2, 1.0])}),
             "example": _mode({1024: (0.9, [0.3, 0.3]), 6144: (1.0, [0.5, 0.5])}),
             "engine_cache": _mode({1024: (0.5, [0.05, 0.05]), 6144: (2.0, [0.1, 0.1])})}
    r = bench.ratios(modes, (1024, 6144))
    assert r["ttft_hit_vs_recompute"] == pytest.approx(0.1)  # medians at 6144
    assert r["ttft_hit_vs_example_connector"] == pytest.approx(0.4)
    # hits of both lengths pooled, each over its length's median (0.1 and 0.2): the tail is
    # the 1.0 s hit, 5x its length's median, not the gap between the lengths
    pooled = [1.0, 1.0, 1.0, 1.0, 1.0, 5.0]
    assert r["ttft_hit_p99_vs_median"] == pytest.approx(float(np.percentile(pooled, 99)))
    # the engine's first request is the first one on the shortest (first) document
    assert r["first_request_vs_no_connector"] == pytest.approx(0.6 / 0.5)
    assert r["miss_penalty"] == pytest.approx(0.2 / 2.0)  # first requests at 6144
    assert r["ttft_hit_vs_engine_cache"] == pytest.approx(2.0)
    # loading adds 0.1 s to the 0.1 s floor with kvpool, 0.4 s with ExampleConnector
    assert r["load_vs_example_connector"] == pytest.approx(0.25)
    host = {name for name in bench.TARGETS if name.startswith(HOST_CASES)}
    copies = set(bench.load_copy_ratios(modes, (1024, 6144), 1e-9))
    assert set(r) | copies == (set(bench.TARGETS) - host) | set(bench.CONTEXT)


def test_load_copy_ratios_compare_the_engine_s_load_wait_with_a_memcpy_here() -> None:
    modes = {"kvpool": {"connector_counters": {"loaded_tokens": 100, "load_wait_us": 20},
                        "chunk_bytes": 1000, "chunk_tokens": 10},
             "engine_cache": _mode({25: (0.5, [0.1, 0.1])})}
    # 100 tokens x 100 bytes at 1 ns a byte: 10 us of memcpy, 20 us waited
    r = bench.load_copy_ratios(modes, (25,), 1e-9)
    assert r["load_vs_memcpy"] == pytest.approx(0.5)
    # the longest document's whole chunks: 20 tokens, 2,000 bytes, 2 us over a 0.1 s floor
    assert r["memcpy_bound_vs_engine_cache"] == pytest.approx((0.1 + 2e-6) / 0.1)
    for missing in ({"connector_counters": None}, {"connector_counters": {"load_wait_us": 5}}):
        modes["kvpool"] = missing
        assert all(np.isnan(v) for v in bench.load_copy_ratios(modes, (25,), 1e-9).values())


def test_the_memcpy_reference_is_the_median_of_its_timed_copies(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake clock: the three copies take 3, 1 and 2 s; the reference is their median."""
    ticks = iter([0.0, 3.0, 10.0, 11.0, 20.0, 22.0])
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(ticks))
    assert bench.memcpy_seconds(1 << 20, repeats=3, piece=1 << 18) == 2.0


#: The host cases' ratios (``host_ratios``), apart from ``ratios``'.
HOST_CASES = ("cross_instance_", "tp2_")


def _host_cases(same: bool) -> dict[str, Any]:
    """Host cases as ``_host_cases`` returns them: engine B at 0.05 s; TP=2 with a recompute
    run of its own (1.0 s) whose tokens B matches or not."""
    return {"cross_instance": {"b": _mode({1024: (0.5, [0.05, 0.05])}), "b_token_ids": [[7]]},
            "tp2": {"b": _mode({1024: (0.5, [0.05, 0.05])}), "b_token_ids": [[7]],
                    "recompute": _mode({1024: (1.0, [1.0, 1.0])}),
                    "recompute_token_ids": [[7] if same else [8]]}}


def test_host_ratios_compare_engine_b_with_the_recompute_of_its_own_shape() -> None:
    modes = {"recompute": _mode({1024: (0.5, [0.5, 0.5])})}
    r = bench.host_ratios(_host_cases(same=False), [[7]], modes, (1024,))
    assert r["cross_instance_ttft_hit_vs_recompute"] == pytest.approx(0.1)  # vs the TP=1 run
    assert r["tp2_ttft_hit_vs_recompute"] == pytest.approx(0.05)  # vs its own TP=2 run
    assert r["cross_instance_outputs_identical"] == 1.0
    assert r["tp2_outputs_identical"] == 0.0  # a token differs
    assert set(r) == {name for name in bench.TARGETS if name.startswith(HOST_CASES)}


def test_report_prints_every_ratio_with_its_target(capsys: pytest.CaptureFixture[str]) -> None:
    modes = {m: _mode({1024: (0.5, [0.1, 0.2])}) for m in bench.MODES}
    modes["engine_cache"] = _mode({1024: (0.5, [0.05, 0.05])})
    ratios = {**bench.ratios(modes, (1024,)), **bench.load_copy_ratios(modes, (1024,), 1e-9),
              **bench.host_ratios(_host_cases(same=True), [[7]], modes, (1024,))}
    report = {"model": "m", "engine": "e", "lengths": [1024], "repeats": 2, "modes": modes,
              "ratios": ratios, "targets": dict(bench.TARGETS)}
    bench._print(report)
    out = capsys.readouterr().out
    for name, target in bench.TARGETS.items():
        assert f"{name}: " in out and f"(target {target}" in out
    for name in bench.CONTEXT:
        assert f"{name}: " in out and "(no target: " in out
    assert "pooled" in out and "first request of a fresh engine" in out


def test_an_engine_bench_command_writes_json_or_says_why_it_failed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvpool.bench.stats import BenchFailure, run_in_work_dir

    seen: list[Path] = []

    def ok(work: Path) -> dict[str, Any]:
        seen.append(work)
        return {"ratios": {"x": 1.0}}

    def failing(work: Path) -> dict[str, Any]:
        seen.append(work)
        raise BenchFailure("no vLLM venv")

    out = tmp_path / "r" / "report.json"
    assert run_in_work_dir("vllm", None, str(out), ok, lambda r: print("shown", r)) == 0
    assert json.loads(out.read_text()) == {"ratios": {"x": 1.0}}
    assert "shown" in capsys.readouterr().out and not seen[0].exists()  # temp dir removed
    (tmp_path / "w").mkdir()
    assert run_in_work_dir("serve", str(tmp_path / "w"), None, failing, print) == 2
    assert "kvpool bench serve: no vLLM venv" in capsys.readouterr().err
    assert seen[1] == tmp_path / "w" and seen[1].exists()  # a given work dir is kept


def test_a_second_run_pools_its_hits_and_keeps_the_first_runs_first_request() -> None:
    first = {"1024": {"median_s": 0.2, "p99_s": 0.3, "samples_s": [0.1, 0.2, 0.3],
                      "first_request_s": 4.0}}
    second = {"1024": {"median_s": 0.5, "p99_s": 0.6, "samples_s": [0.4, 0.5, 0.6],
                       "first_request_s": 0.15}}
    pooled = bench._pooled(first, second)["1024"]
    assert pooled["samples_s"] == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    assert pooled["median_s"] == pytest.approx(0.35)
    assert pooled["p99_s"] == pytest.approx(np.percentile(pooled["samples_s"], 99))
    assert pooled["first_request_s"] == 4.0
