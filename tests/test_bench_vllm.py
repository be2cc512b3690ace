"""`kvpool bench vllm` labels its engine with what each run reported (run_engine's ``engine``),
not a constant. The engine runs are replaced at ``_run`` (a real one needs the vLLM venv and
minutes; tests/vllm check that run_engine reports ``engine``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvpool.bench import vllm as bench
from kvpool.integrations.models import smollm2


def test_the_engine_label_is_what_ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[dict[str, Any]] = []

    def fake_run(python: str, spec: dict[str, Any], work: Path, name: str) -> dict[str, Any]:
        ran.append(spec)
        return {"outputs": [{"wall_s": 0.5 if name == "recompute" else 0.1}
                            for _ in spec["prompts"]],
                "connector_stats": None,
                "engine": {"vllm_version": "9.8.7", "device": "cpu", "dtype": "float32",
                           "enforce_eager": True, "model": spec["model"]}}

    monkeypatch.setattr(bench, "_run", fake_run)
    monkeypatch.setattr(bench, "vllm_python", lambda: "python")
    monkeypatch.setattr(smollm2, "smollm2_hf_dir", lambda: tmp_path / "model")
    report = bench.run_vllm_bench(quick=True, repeats=1, work=tmp_path)
    assert len(ran) == len(bench.MODES)
    assert report["engine"] == "vllm 9.8.7 on cpu (float32, eager)"
    assert report["modes"]["kvpool"]["engine"]["model"] == str(tmp_path / "model")
    assert report["ratios"]["ttft_hit_vs_recompute"] == pytest.approx(0.2)


def test_engine_label_names_compiled_runs() -> None:
    info = {"vllm_version": "0.32.0", "device": "cuda", "dtype": "bfloat16",
            "enforce_eager": False}
    assert bench.engine_label(info) == "vllm 0.32.0 on cuda (bfloat16, compiled)"
