"""``kvpool bench host`` end to end with few passes: a real host pool, a real node, real
attached processes; the report's figures exist and the attached reads went directly."""

from __future__ import annotations

from pathlib import Path

from kvpool.bench.host import run_host_bench


def test_the_host_bench_reports_every_figure_and_reads_through_the_directory(
        tmp_path: Path) -> None:
    report = run_host_bench(tmp_path, passes=3, log=lambda line: None)
    assert set(report["ratios"]) == set(report["targets"]) == {
        "host_get_vs_inprocess", "host_get_vs_loopback_node", "host_dram_copies_4_engines"}
    assert all(value > 0 for value in report["ratios"].values())
    assert report["ratios"]["host_dram_copies_4_engines"] < 1.5  # one copy held, not four
    reads = report["attached_reads"]
    assert 0 < reads["direct_hits"] <= reads["dram_hits"]  # the reads asked nothing
