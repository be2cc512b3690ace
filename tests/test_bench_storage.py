"""`kvpool bench storage` at a tiny size: the run completes, verifies its reads, cleans up
and reports every figure. No timing assertions: this machine is shared and noisy."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvpool.bench import storage
from kvpool.bench.stats import BenchFailure, PassResult, Timing, run_pass, split
from kvpool.bench.storage_metrics import METRICS_CASES
from kvpool.bench.storage_prefetch import PREFETCH_CHUNKS
from kvpool.cli import main

KiB = 1024
MiB = 1 << 20

TINY = storage.Plan(
    sizes=(16 * KiB, 256 * KiB), repeats=2, dram_pass_bytes=1 * MiB, ssd_pass_bytes=1 * MiB,
    min_chunks=4, max_chunks=32, small_size=16 * KiB, small_chunks=120, durable_chunks=12,
    headline_size=256 * KiB, segment_size=4 * MiB, dram_slab=4 * MiB, batch=4,
    prefix_pass_bytes=512 * KiB,
)

REQUIRED_RATIOS = (
    "dram_get_vs_memcpy", "dram_put_vs_memcpy", "ssd_read_vs_raw", "ssd_write_vs_raw",
    "small_read_vs_file_per_chunk", "small_write_vs_file_per_chunk",
    "prefix_read_vs_file_per_chunk", "prefix_read_vs_sequential", "prefix_load_prefetch_vs_none",
    "metrics_on_vs_off_get_into", "metrics_on_vs_off_get_many_into", "metrics_on_vs_off_lookup",
    "pool_ssd_write_vs_raw", "small_engine_write_vs_file_per_chunk",
)


def _positive(x: object) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_tiny_run_reports_every_case(tmp_path: Path) -> None:
    res = storage.run_storage_bench(tmp_path, TINY)
    data = json.loads(json.dumps(res.data))  # JSON-serialisable as is
    for name in REQUIRED_RATIOS:
        assert _positive(data["ratios"][name]), name
        assert data["ratio_basis"][name]
    assert _positive(data["index_bytes_per_chunk"])
    assert data["info"]["small_chunks_stored"] == TINY.small_chunks

    cases = {c["id"]: c for c in data["cases"]}
    assert len(cases) == len(data["cases"])  # ids are unique
    for size in TINY.sizes:
        for op in ("put", "put evicting", "get_into"):
            assert f"dram/{op}/{size}/1t" in cases
        for op in ("write seq", "write rand", "read seq cold", "read rand cold"):
            for t in TINY.threads:
                assert f"ssd/{op}/{size}/{t}t" in cases
        assert f"ssd/put_many/{size}/1t" in cases
        assert f"ssd/get_many_into cold/{size}/4t" in cases
    for n in TINY.prefix_lengths:  # one op = one prefix of n chunks
        for case in (f"read {n} cold", f"read {n} cold vs sequential"):
            row = cases[f"prefix/{case}/{TINY.small_size}/1t"]
            assert row["prefix_chunks"] == n
            assert row["kvpool"]["bytes_per_op"] == n * TINY.small_size
    assert data["ratio_basis"]["prefix_read_vs_sequential"].startswith("prefix/read ")
    assert data["ratio_basis"]["pool_ssd_write_vs_raw"] == f"pool/write/{MiB}/1t"
    assert data["ratio_basis"]["small_write_vs_file_per_chunk"] == \
        f"small/pool write/{TINY.small_size}/1t"
    assert set(data["info"]["pool_write_costs_us"]) == {"staging_copy", "checksum"}
    # every prefix read was one coalesced read (each batch fits one 4 MiB segment or two)
    assert data["info"]["prefix_coalesced_reads"] >= TINY.repeats * sum(
        max(2, TINY.prefix_pass_bytes // (n * TINY.small_size)) for n in TINY.prefix_lengths)
    assert data["info"]["prefetched"] > 0  # the kvpool side's lookups moved chunks up
    assert f"prefetch/load {PREFETCH_CHUNKS} after lookup/{TINY.small_size}/1t" in cases
    for case in METRICS_CASES:
        assert f"metrics/{case}/{TINY.small_size}/1t" in cases
    for c in data["cases"]:
        for side in ("kvpool", "reference"):
            fig = c[side]
            for key in ("median_s", "p99_s", "ops_per_s", "gb_per_s"):
                assert _positive(fig[key]), (c["id"], side, key)
            assert fig["p99_s"] >= fig["median_s"]
            assert fig["passes"] == TINY.repeats
            assert fig["bytes_per_op"] == c["chunk_bytes"] * c.get("prefix_chunks", 1)
        assert _positive(c["ratio"])
        assert c["reference_name"]
    # the scratch directory is gone
    assert list(tmp_path.iterdir()) == []


def test_cli_quick_flags_and_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(storage.Plan, "quick_plan", classmethod(lambda cls: TINY))
    out = tmp_path / "out" / "bench.json"
    rc = main(["bench", "storage", "--quick", "--repeats", "1", "--dir",
               str(tmp_path / "scratch"), "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert set(REQUIRED_RATIOS) <= set(data["ratios"])
    assert data["plan"]["repeats"] == 1
    printed = capsys.readouterr().out
    assert "ratio" in printed and "raw O_DIRECT" in printed and "file per chunk" in printed
    assert list((tmp_path / "scratch").iterdir()) == []


def test_cli_only_runs_the_cases_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(storage.Plan, "quick_plan", classmethod(lambda cls: TINY))
    out = tmp_path / "bench.json"
    rc = main(["bench", "storage", "--quick", "--repeats", "1", "--only", "pool_write",
               "--dir", str(tmp_path / "scratch"), "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert list(data["ratios"]) == ["pool_ssd_write_vs_raw"]
    assert [c["id"] for c in data["cases"]] == [f"pool/write/{MiB}/1t"]
    assert data["plan"]["only"] == ["pool_write"]
    with pytest.raises(SystemExit):  # argparse names the cases
        main(["bench", "storage", "--only", "nope", "--dir", str(tmp_path)])
    assert "pool_write" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown case"):
        storage.run_storage_bench(tmp_path, storage.Plan(only=("nope",)))


def test_cli_rejects_bad_repeats(tmp_path: Path) -> None:
    assert main(["bench", "storage", "--quick", "--repeats", "0", "--dir", str(tmp_path)]) == 2


def test_run_pass_threads_and_failures() -> None:
    seen: list[tuple[int, int]] = []

    def op(t: int, i: int) -> bool:
        seen.append((t, i))
        return i != 5

    r = run_pass(op, list(range(10)), threads=4)
    assert r.ops == 10 and r.failures == 1 and len(r.latencies) == 10 and r.wall_s > 0
    assert sorted(i for _t, i in seen) == list(range(10))
    # contiguous slices: thread t got split()[t]
    for t, part in enumerate(split(list(range(10)), 4)):
        assert sorted(i for tt, i in seen if tt == t) == list(part)
    timing = Timing(1)
    with pytest.raises(BenchFailure):
        timing.add(r)


def test_run_pass_reraises_worker_errors() -> None:
    def op(_t: int, i: int) -> bool:
        if i == 3:
            raise RuntimeError("boom")
        return True

    with pytest.raises(RuntimeError, match="boom"):
        run_pass(op, list(range(8)), threads=2)


def test_timing_figures() -> None:
    t = Timing(1_000_000, items_per_op=2)
    t.add(PassResult([0.001] * 99 + [0.1], wall_s=0.5, ops=100, failures=0))
    t.add(PassResult([0.001] * 100, wall_s=0.25, ops=100, failures=0))
    assert t.median_s == pytest.approx(0.0005)
    assert t.p99_s >= t.median_s
    assert t.ops_per_s == pytest.approx((400 + 800) / 2)  # median of 2 passes = their mean
    assert t.gb_per_s == pytest.approx(t.ops_per_s * 1e6 / 1e9)
    s = t.summary()
    assert s["passes"] == 2 and s["items_per_pass"] == 200
