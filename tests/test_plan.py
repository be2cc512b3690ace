"""kvpool plan: trace reading, Belady, each policy and the SSD model on hand-made traces with
known answers, determinism, and the CLI's JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from plan_traces import prefix_tree_requests, write_trace

from kvpool.cli import main
from kvpool.plan.belady import belady, next_use
from kvpool.plan.replay import TierConfig, replay
from kvpool.plan.ssd import SsdModel, records_per_segment
from kvpool.plan.trace import read_trace
from kvpool.policy import EVICTION_POLICIES

# ----------------------------------------------------------------------------- trace


def test_trace_chunks_tokens_and_splitting(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [[7, 8, 9], [7, 5]], lengths=[1300, 600])
    # By default a partial last chunk (276 and 88 tokens here) is no reference at all.
    assert read_trace(path).keys.tolist() == [7, 8, 7]
    # Stored as an engine that saves unfull chunks would: the tokens it holds, a full chunk.
    t = read_trace(path, store_partial=True)
    assert t.keys.tolist() == [7, 8, 9, 7, 5]
    assert t.tokens.tolist() == [512, 512, 276, 512, 88]
    assert t.starts.tolist() == [0, 3, 5]
    assert t.input_tokens.tolist() == [1300, 600]
    assert (t.requests, t.references, t.distinct) == (2, 5, 4)
    assert t.timestamps.tolist() == [0.0, 0.01]
    # 256-token chunks: id h becomes 2h and 2h+1; a short last block keeps only what it holds.
    s = read_trace(path, block_tokens=256, store_partial=True)
    assert s.keys.tolist() == [14, 15, 16, 17, 18, 19, 14, 15, 10]
    assert s.tokens.tolist() == [256, 256, 256, 256, 256, 20, 256, 256, 88]
    assert s.starts.tolist() == [0, 6, 9]
    assert t.head(1).keys.tolist() == [7, 8, 9]


@pytest.mark.parametrize(("line", "fragment"), [
    ("{not json", "not valid JSON"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "missing field(s) hash_ids"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": []}',
     "hash_ids must be a non-empty list"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}',
     "input_length must be an integer >= 1"),
    ('[1, 2]', "expected a JSON object"),
])
def test_malformed_line_is_named(tmp_path: Path, line: str, fragment: str) -> None:
    path = write_trace(tmp_path / "bad.jsonl", [[1, 2]])
    with path.open("a", encoding="utf-8") as f:
        f.write("\n" + line + "\n")  # a blank line 2 is skipped; the bad one is line 3
    with pytest.raises(ValueError, match=r"bad\.jsonl line 3") as err:
        read_trace(path)
    assert fragment in str(err.value)


def test_block_tokens_must_divide_the_trace_block(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [[1]])
    with pytest.raises(ValueError, match="must divide 512"):
        read_trace(path, block_tokens=100)

# ----------------------------------------------------------------------------- Belady


def test_next_use() -> None:
    assert next_use(np.array([5, 6, 5, 7, 6, 5])).tolist() == [2, 4, 5, 6, 6, 6]


def test_belady_single_chunk_requests(tmp_path: Path) -> None:
    # A B C A B D A C, capacity 2: C (next use 7) is kept out at 2, since A (3) and B (4)
    # come back sooner; A, B, A hit.
    a, b, c, d = 1, 2, 3, 4
    t = read_trace(write_trace(tmp_path / "t.jsonl", [[a], [b], [c], [a], [b], [d], [a], [c]]))
    r = belady(t, 2)
    assert r.hits.tolist() == [0, 0, 0, 1, 1, 0, 1, 0]
    assert r.resident_hits == 3
    assert belady(t, 0).hits.sum() == 0
    assert belady(t, 100).hits.sum() == 4  # every reuse: A twice, B once, C once


def test_belady_prefix_hits_and_tokens(tmp_path: Path) -> None:
    # [1,2] [1,3] [1,2] at capacity 2: chunk 3 is never used again, so it is kept out and
    # the third request finds its whole prefix.
    t = read_trace(write_trace(tmp_path / "t.jsonl", [[1, 2], [1, 3], [1, 2]],
                               lengths=[1024, 1024, 700]), store_partial=True)
    r = belady(t, 2)
    assert r.hits.tolist() == [0, 1, 2]
    assert r.hit_tokens.tolist() == [0, 512, 700]

# ----------------------------------------------------------------------------- policies


def _hits(path: Path, policy: str, capacity: int) -> list[int]:
    res = replay(read_trace(path), TierConfig(policy, capacity), 4096)
    assert res.ssd_hits.sum() == 0
    return list(res.hits.tolist())


def test_lru_known_answers(tmp_path: Path) -> None:
    single = write_trace(tmp_path / "s.jsonl", [[1], [2], [1], [3], [2]])
    assert _hits(single, "lru", 2) == [0, 0, 1, 0, 0]  # 3 evicts 2, the least recent
    # Head-first eviction wastes a prefix: at 2 chunks, [3] evicts 1 and the prefix [1, 2]
    # is lost although 2 is still resident; at 3 chunks it is whole.
    prefix = write_trace(tmp_path / "p.jsonl", [[1, 2], [3], [1, 2]])
    assert _hits(prefix, "lru", 2) == [0, 0, 0]
    assert _hits(prefix, "lru", 3) == [0, 0, 2]


def test_s3fifo_resists_a_scan_that_lru_does_not(tmp_path: Path) -> None:
    # H is read once (so it earns the main queue), then 20 one-hit chunks pass through a
    # 10-chunk DRAM: S3-FIFO keeps H, LRU does not.
    hot = 1000
    reqs = [[hot], [hot], *[[i] for i in range(20)], [hot]]
    path = write_trace(tmp_path / "scan.jsonl", reqs)
    assert _hits(path, "s3fifo", 10) == [0, 1, *[0] * 20, 1]
    assert _hits(path, "lru", 10) == [0, 1, *[0] * 20, 0]


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
def test_every_policy_with_room_for_everything_hits_every_reuse(tmp_path: Path,
                                                                policy: str) -> None:
    reqs = prefix_tree_requests(150, seed=3)
    t = read_trace(write_trace(tmp_path / "t.jsonl", reqs))
    res = replay(t, TierConfig(policy, t.distinct), 4096)
    best = belady(t, t.distinct)
    assert res.hits.tolist() == best.hits.tolist()
    assert res.hits.sum() == t.references - t.distinct  # only first uses miss
    # Smaller: never above Belady's prefix hits, which bound every policy.
    small = replay(t, TierConfig(policy, t.distinct // 5), 4096)
    assert 0 < small.hits.sum() <= belady(t, t.distinct // 5).resident_hits


def test_unknown_policy_is_refused(tmp_path: Path) -> None:
    t = read_trace(write_trace(tmp_path / "t.jsonl", [[1]]))
    with pytest.raises(ValueError, match="unknown eviction policy"):
        replay(t, TierConfig("nope", 4), 4096)


def test_replay_is_deterministic(tmp_path: Path) -> None:
    t = read_trace(write_trace(tmp_path / "t.jsonl", prefix_tree_requests(300, seed=1)))
    for cfg in (TierConfig("s3fifo", t.distinct // 4),
                TierConfig("lru", t.distinct // 8, ssd_segments=4, segment_size=64 << 10),
                TierConfig("s3fifo", t.distinct // 8, ssd_segments=3, segment_size=64 << 10,
                           ssd_write="evict", admission="second_use")):
        a, b = replay(t, cfg, 4096), replay(t, cfg, 4096)
        assert a.dram_hits.tolist() == b.dram_hits.tolist()
        assert a.ssd_hits.tolist() == b.ssd_hits.tolist()
        assert a.counters == b.counters
    assert a.ssd_hits.sum() > 0

# ----------------------------------------------------------------------------- SSD model


def test_ssd_segments_second_chance_and_fifo() -> None:
    # 32 KiB segments of 4 KiB chunks: a header block, 3 records of 8 KiB, the summary.
    assert records_per_segment(32 << 10, 4096) == 3
    ssd = SsdModel("second_chance", 2, 32 << 10, 4096)
    for k in range(1, 7):
        ssd.write(k)
    ssd.read(2)
    ssd.read(3)
    ssd.write(7)  # the oldest segment (1, 2, 3) goes; the budget (8 KiB) forwards one hot
    assert {k for k in range(1, 8) if k in ssd} == {2, 4, 5, 6, 7}
    assert (ssd.forwarded, ssd.dropped, ssd.segments_evicted) == (1, 2, 1)
    fifo = SsdModel("fifo", 2, 32 << 10, 4096)
    for k in range(1, 8):
        fifo.write(k)
    assert {k for k in range(1, 8) if k in fifo} == {4, 5, 6, 7}
    with pytest.raises(ValueError, match="at least 2 segments"):
        SsdModel("fifo", 1, 32 << 10, 4096)


def test_ssd_hits_promote_into_dram(tmp_path: Path) -> None:
    # DRAM of 1 chunk, an SSD that holds everything. After the first [1, 2] DRAM holds 2;
    # the second reads 1 from the SSD and 2 from DRAM, then promotes 1 (evicting 2); the
    # third reads 1 from DRAM and 2 from the SSD.
    t = read_trace(write_trace(tmp_path / "t.jsonl", [[1, 2], [1, 2], [1, 2]]))
    res = replay(t, TierConfig("lru", 1, ssd_segments=2, segment_size=32 << 10), 4096)
    assert res.dram_hits.tolist() == [0, 1, 1]
    assert res.ssd_hits.tolist() == [0, 1, 1]
    assert res.counters["ssd_writes"] == 2  # through: the first request's puts only
    assert res.counters["dram_writes"] == 4  # two puts, two promotions

def test_without_dram_the_ssd_gets_every_put(tmp_path: Path) -> None:
    t = read_trace(write_trace(tmp_path / "t.jsonl", [[1, 2], [1, 2, 3]]))
    for mode in ("through", "evict"):
        res = replay(t, TierConfig("lru", 0, ssd_segments=2, segment_size=64 << 10,
                                   ssd_write=mode), 4096)
        assert res.ssd_hits.tolist() == [0, 2] and res.dram_hits.sum() == 0
        assert res.counters["ssd_writes"] == 3

# ----------------------------------------------------------------------------- CLI


def test_cli_json_has_the_ratios(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", prefix_tree_requests(200, seed=2))
    out = tmp_path / "plan.json"
    rc = main(["plan", "--trace", str(trace), "--bytes-per-token", "8", "--dram", "10%",
               "1MiB", "--ssd", "0", "40%", "--ssd-segment", "64KiB", "--policy", "lru",
               "s3fifo", "--json", str(out), "--ttft-p99", "1000"])
    assert rc == 0
    data = json.loads(out.read_text())
    ratios = data["ratios"]
    for name in ("hit_rate_vs_belady_10pct", "hit_rate_vs_belady_25pct"):
        assert 0 < ratios[name] <= 1.0 + 1e-9 and math.isfinite(ratios[name])
        assert data["ratio_basis"][name]["policy"] == data["settings"]["default_policy"]
    assert len(data["rows"]) == 2 * 2 * 2 and len(data["belady"]) == 2
    row = next(r for r in data["rows"] if r["ssd"] == "40%" and r["dram"] == "10%")
    assert row["ssd_written_bytes"] > 0 and row["ssd_write_amplification"] >= 0
    assert row["ssd_chunk_hit_rate"] > 0
    assert data["chunk_bytes"] == 512 * 8
    assert data["cheapest"] is not None  # with a 1000 s target everything qualifies
    assert data["cheapest"]["usd_per_mtok"] == min(
        [data["no_cache"]["usd_per_mtok"]] + [r["usd_per_mtok"] for r in data["rows"]])
    # The same planner under ``kvpool bench trace``.
    again = tmp_path / "again.json"
    assert main(["bench", "trace", "--trace", str(trace), "--bytes-per-token", "8",
                 "--dram", "10%", "1MiB", "--ssd", "0", "40%", "--ssd-segment", "64KiB",
                 "--policy", "lru", "s3fifo", "--json", str(again)]) == 0
    assert json.loads(again.read_text())["rows"] == [
        {**r, "elapsed_s": json.loads(again.read_text())["rows"][i]["elapsed_s"]}
        for i, r in enumerate(data["rows"])]


def test_cli_names_the_bad_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [[1]])
    with trace.open("a", encoding="utf-8") as f:
        f.write('{"timestamp": "x"}\n')
    assert main(["plan", "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert "t.jsonl line 2" in err and err.startswith("kvpool plan:")


def test_cli_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    trace = write_trace(tmp_path / "t.jsonl", prefix_tree_requests(60, seed=4))
    assert main(["plan", "--trace", str(trace), "--bytes-per-token", "8", "--dram", "10%",
                 "50%", "--ssd", "0", "--plot", str(tmp_path / "plots")]) == 0
    for name in ("hit_rate.png", "ttft_p99.png", "cost_per_mtok.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_model_bytes_per_token_match_the_integration() -> None:
    pytest.importorskip("torch")
    from kvpool.integrations.models.smollm2 import SMOLLM2_EXPECTED
    from kvpool.plan.cost import model_bytes_per_token
    assert model_bytes_per_token("smollm2-135m") == SMOLLM2_EXPECTED["kv_bytes_per_token_fp32"]
    with pytest.raises(ValueError, match="--bytes-per-token"):
        model_bytes_per_token("gpt-9")
