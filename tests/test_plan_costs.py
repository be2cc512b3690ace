"""kvpool plan (issue 25): partial last chunks are never stored, costs are taken over the
trace's own span, ``vs Belady`` compares like with like, distinct plot series, bad inputs get
one line and exit 2, and a request hit figure that can be below 1."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from plan_traces import prefix_tree_requests, write_trace

from kvpool.cli import main
from kvpool.plan import cost
from kvpool.plan.replay import TierConfig, replay
from kvpool.plan.trace import read_trace

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"


def _plan(tmp_path: Path, trace: Path, *args: str) -> dict:
    out = tmp_path / "plan.json"
    assert main(["plan", "--trace", str(trace), "--json", str(out), *args]) == 0
    return json.loads(out.read_text())


# ------------------------------------------------------------------ partial last chunks


def test_partial_last_chunk_is_never_stored(tmp_path: Path) -> None:
    # Two identical prompts of 700 tokens: one full block and a partial one of 188 tokens.
    path = write_trace(tmp_path / "t.jsonl", [[1, 2], [1, 2]], lengths=[700, 700])
    t = read_trace(path)
    assert t.keys.tolist() == [1, 1]  # the partial chunk is no reference: never looked up
    assert t.partial_tokens is not None and t.partial_tokens.tolist() == [188, 188]
    assert t.input_tokens.tolist() == [700, 700]  # its tokens are still prefilled
    res = replay(t, TierConfig("lru", 100), 512 * 8)
    assert res.counters["dram_writes"] == 1  # only the full chunk was stored
    assert res.hit_tokens.tolist() == [0, 512]
    # As before, for an engine that saves unfull chunks.
    kept = read_trace(path, store_partial=True)
    assert kept.keys.tolist() == [1, 2, 1, 2]
    assert replay(kept, TierConfig("lru", 100), 512 * 8).counters["dram_writes"] == 2
    # A prompt of whole blocks has no partial chunk; at 256-token chunks only the last
    # sub-chunk of a short block is partial.
    assert read_trace(write_trace(tmp_path / "w.jsonl", [[1, 2]])).keys.tolist() == [1, 2]
    longer = write_trace(tmp_path / "l.jsonl", [[1, 2]], lengths=[800])  # 512 + 256 + 32
    assert read_trace(longer, block_tokens=256).keys.tolist() == [2, 3, 4]
    data = _plan(tmp_path, path, "--bytes-per-token", "8", "--dram", "100%", "--ssd", "0",
                 "--policy", "lru")
    assert data["trace"]["partial_chunks_not_stored"] == 2
    assert data["rows"][0]["dram_written_bytes"] == 512 * 8


# ------------------------------------------------------------------ cost over the span


def _spaced_trace(tmp_path: Path) -> Path:
    """60 requests, one a second, each repeating a shared 8-block prefix plus a new block."""
    path = tmp_path / "spaced.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for i in range(60):
            f.write(json.dumps({"timestamp": i * 1000, "input_length": 9 * 512,
                                "output_length": 1,
                                "hash_ids": [*range(8), 100 + i]}) + "\n")
    return path


def test_cost_is_taken_over_the_trace_span(tmp_path: Path) -> None:
    trace = _spaced_trace(tmp_path)
    data = _plan(tmp_path, trace, "--dram", "100%", "--ssd", "0", "--policy", "lru")
    span, m = data["cost_span_s"], data["cost_model"]
    assert span == pytest.approx(59.0)
    assert data["cost_preset"] == "cpu" and data["model"] == "smollm2-135m"
    assert "measured" in data["cost_sources"]["prefill_s_per_token"]
    assert "assumed" in data["cost_sources"]["engine_hour_usd"]
    tokens = data["trace"]["prompt_tokens"]
    base, row = data["no_cache"], data["rows"][0]
    # Without a cache the engines compute every prompt token within the span.
    assert base["engines"] == pytest.approx(tokens * m["prefill_s_per_token"] / span)
    assert base["engines_whole"] == math.ceil(base["engines"])
    # With one, only the tokens it did not serve; its DRAM is paid for the span, no longer.
    computed = tokens - row["prefill_tokens_saved"]
    assert row["engines"] == pytest.approx(computed * m["prefill_s_per_token"] / span)
    storage = row["dram_bytes"] / (1 << 30) * m["dram_gib_month_usd"] / (730 * 3600) * span
    assert row["storage_usd_per_mtok"] == pytest.approx(storage / (tokens / 1e6))
    assert row["usd_per_mtok"] == pytest.approx(row["engine_usd_per_mtok"]
                                                + row["storage_usd_per_mtok"])
    assert row["usd_per_mtok"] < base["usd_per_mtok"]  # 8 of 9 blocks reused: it pays


def test_presets_set_the_engine_and_flags_override_them(tmp_path: Path) -> None:
    trace = _spaced_trace(tmp_path)
    gpu = _plan(tmp_path, trace, "--preset", "gpu-70b", "--dram", "100%", "--ssd", "0",
                "--policy", "lru")
    assert gpu["model"] == "llama-3-70b" and gpu["cost_preset"] == "gpu-70b"
    assert gpu["bytes_per_token"] == cost.MODELS["llama-3-70b"][0]
    for name, value in cost.PRESETS["gpu-70b"].figures.items():
        assert gpu["cost_model"][name] == value
    assert gpu["rows"][0]["usd_per_mtok"] < gpu["no_cache"]["usd_per_mtok"]
    given = _plan(tmp_path, trace, "--preset", "gpu-70b", "--gpu-hour-usd", "9",
                  "--dram", "100%", "--ssd", "0", "--policy", "lru")
    assert given["cost_model"]["engine_hour_usd"] == 9
    assert given["cost_sources"]["engine_hour_usd"].startswith("given")


@pytest.mark.skipif(not (SHARED / "conversation_head.jsonl").exists(),
                    reason="needs ../shared/traces/conversation_head.jsonl")
@pytest.mark.parametrize("preset", ["cpu", "gpu-70b"])
def test_caching_pays_on_the_conversation_head(tmp_path: Path, preset: str) -> None:
    data = _plan(tmp_path, SHARED / "conversation_head.jsonl", "--requests", "1500",
                 "--preset", preset, "--dram", "10%", "--ssd", "0", "--policy", "lru")
    assert data["rows"][0]["usd_per_mtok"] < data["no_cache"]["usd_per_mtok"]


# ------------------------------------------------------------------ vs Belady


def test_vs_belady_compares_like_with_like(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", prefix_tree_requests(200, seed=2))
    data = _plan(tmp_path, trace, "--bytes-per-token", "8", "--dram", "5%", "10%",
                 "--ssd", "0", "40%", "--ssd-segment", "64KiB", "--policy", "lru", "s3fifo")
    for r in data["rows"]:
        assert r["belady_basis"] == ("dram+ssd" if r["ssd_bytes"] else "dram")
        assert r["belady_capacity_chunks"] == r["dram_chunks"] + r["ssd_chunks"]
        assert r["vs_belady"] <= 1.0 + 1e-9, r  # Belady at the same capacity bounds it


# ------------------------------------------------------------------ plots


def test_plot_series_are_distinct_and_the_legend_is_outside(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from kvpool.plan.plots import CHARTS, figure, series_style
    styles = {(series_style(i)["color"], series_style(i)["marker"]) for i in range(24)}
    assert len(styles) == 24
    trace = write_trace(tmp_path / "t.jsonl", prefix_tree_requests(80, seed=4))
    data = _plan(tmp_path, trace, "--bytes-per-token", "8", "--dram", "10%", "50%",
                 "--ssd", "0", "40%", "--ssd-segment", "64KiB")
    for _, key, ylabel in CHARTS:
        fig = figure(data, key, ylabel)
        ax = fig.axes[0]
        lines = [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]
        pairs = {(tuple(ln.get_color()) if not isinstance(ln.get_color(), str)
                  else ln.get_color(), ln.get_marker()) for ln in lines}
        assert len(pairs) == len(lines)  # 6 policy series, Belady (and no cache)
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        legend = ax.get_legend().get_window_extent(renderer)
        assert legend.x0 >= ax.get_window_extent(renderer).x1  # right of the data
        import matplotlib.pyplot as plt
        plt.close(fig)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("args", [
    ["--dram", "inf%"], ["--dram", "1e400%"], ["--ssd", "nan%"], ["--ttft-p99=-1"],
    ["--ttft-p99", "nan"], ["--prefill-s-per-token", "inf"], ["--gpu-hour-usd", "nan"],
])
def test_bad_option_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    args: list[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [[1, 2], [1, 3]])
    assert main(["plan", "--trace", str(trace), "--bytes-per-token", "8", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpool plan:") and err.count("\n") == 1, err


@pytest.mark.parametrize("timestamp", ["-5", "NaN", "Infinity"])
def test_bad_timestamp_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       timestamp: str) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [[1]])
    with trace.open("a", encoding="utf-8") as f:
        f.write(f'{{"timestamp": {timestamp}, "input_length": 512, "output_length": 1, '
                '"hash_ids": [1]}\n')
    assert main(["plan", "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpool plan:") and "t.jsonl line 2" in err and "timestamp" in err
    assert err.count("\n") == 1


# ------------------------------------------------------------------ request hit fraction


def test_request_hit_fraction_can_be_below_one(tmp_path: Path) -> None:
    # Every request starts with block 0, as on the conversation trace: each request after the
    # first hits, so "any chunk hit" was 1.0 for all but the first; half its chunks hit.
    trace = write_trace(tmp_path / "t.jsonl", [[0, 1], [0, 2], [0, 3], [0, 4]])
    data = _plan(tmp_path, trace, "--bytes-per-token", "8", "--dram", "100%", "--ssd", "0",
                 "--policy", "lru")
    row = data["rows"][0]
    assert "request_hit_rate" not in row
    assert row["request_hit_fraction"] == pytest.approx((0 + 0.5 * 3) / 4)
    assert row["chunk_hit_rate"] == pytest.approx(3 / 8)
