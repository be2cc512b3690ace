"""`kvpool bench sglang` end to end on a small plan: SGLang's real host pool in the SGLang
venv, a real node, every system's bytes verified by the runner (a wrong byte fails the run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.bench import sglang as bench


def test_bench_measures_every_system_and_reports_the_ratios(
        sglang_python: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(bench.QUICK, "pages", {"64": 8, "256": 4})
    monkeypatch.setitem(bench.QUICK, "batch", {"64": 4, "256": 2})
    report = bench.run_sglang_bench(quick=True, repeats=1, node=True, work=tmp_path)
    for page in ("64", "256"):
        row = report["pages"][page]
        assert row["page_bytes"] == int(page) * 30 * 2 * 3 * 64 * 2
        for system in bench.SYSTEMS:
            for op in ("set", "get"):
                r = row[system][op]
                assert r["items_per_pass"] == bench.QUICK["pages"][page]
                assert r["ops_per_s"] > 0 and r["gb_per_s"] > 0
    ratios = report["ratios"]
    assert set(ratios) >= {"get_v1_vs_file_backend", "set_v1_vs_file_backend",
                           "get_v1_node_vs_file_backend_64"}
    assert ratios["get_v1_vs_file_backend"] == pytest.approx(
        report["pages"]["256"]["kvpool"]["get"]["ops_per_s"]
        / report["pages"]["256"]["file"]["get"]["ops_per_s"])
