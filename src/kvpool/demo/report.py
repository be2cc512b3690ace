"""Summaries, headline ratios, the table, the JSON object and the chart of a demo run."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kvpool.demo.runner import RequestResult


def by_mode(results: Sequence[RequestResult]) -> dict[str, list[RequestResult]]:
    out: dict[str, list[RequestResult]] = defaultdict(list)
    for r in results:
        out[r.mode].append(r)
    return dict(out)


def summarize(results: Sequence[RequestResult]) -> dict[str, dict[str, Any]]:
    """Per mode: TTFT p50/p99, prefill and end-to-end tokens/s, hit rate, hits per tier,
    median TTFT speedup over recompute, and whether every output equals recompute's."""
    modes = by_mode(results)
    base = modes.get("recompute", [])
    summary: dict[str, dict[str, Any]] = {}
    for mode, rs in modes.items():
        ttft = np.array([r.ttft_s for r in rs])
        tiers: dict[str, int] = defaultdict(int)
        for r in rs:
            for tier, n in r.hits.items():
                tiers[tier] += n
        speedups = [b.ttft_s / r.ttft_s for b, r in zip(base, rs, strict=False)
                    if r.cached_tokens > 0]
        summary[mode] = {
            "requests": len(rs),
            "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p99_s": float(np.percentile(ttft, 99)),
            "prefill_tokens_per_s": sum(r.prompt_tokens for r in rs) / float(ttft.sum()),
            "e2e_tokens_per_s": sum(len(r.tokens) for r in rs) / sum(r.total_s for r in rs),
            "hit_rate": sum(r.cached_tokens for r in rs) / max(1, sum(r.prompt_tokens for r in rs)),
            "chunk_hits_by_tier": dict(tiers),
            "dropped_saves": sum(r.dropped_saves for r in rs),
            "median_speedup_on_hits": float(np.median(speedups)) if speedups else None,
            "outputs_identical": len(rs) == len(base) and all(
                r.tokens == b.tokens for r, b in zip(rs, base, strict=True)),
        }
    return summary


MISS_PENALTY_TARGET = "<= 1.05"


def _cold_pairs(results: Sequence[RequestResult]) -> list[tuple[RequestResult, RequestResult]]:
    """(kvpool, recompute) results of the requests the kvpool mode restored nothing for."""
    modes = by_mode(results)
    kv, rec = modes.get("kvpool"), modes.get("recompute")
    if not kv or not rec:
        return []
    return [(k, r) for k, r in zip(kv, rec, strict=False) if k.cached_tokens == 0]


def miss_penalty(results: Sequence[RequestResult]) -> tuple[float, int] | None:
    """(median over the cold requests of kvpool TTFT / recompute TTFT of the same request,
    number of cold requests). Cold: nothing restored in the kvpool mode (``cached_tokens`` 0),
    so the ratio is what storing the KV costs the request that produced it (> 1 = slower than
    no cache). None when either mode is missing or no request was cold."""
    cold = [k.ttft_s / r.ttft_s for k, r in _cold_pairs(results)]
    return (float(np.median(cold)), len(cold)) if cold else None


def miss_overhead_s(results: Sequence[RequestResult]) -> float | None:
    """Median over the cold requests of what the kvpool mode spends before the first token
    outside the model forward, minus what recompute spends there (seconds): hashing the chunk
    chain, the lookup, handing off the save. The forward is the same computation in both
    modes, so this part of ``miss_penalty`` is kvpool's own, whatever load the rest of the
    machine puts on the forward. None where ``miss_penalty`` is None."""
    cold = [(k.ttft_s - k.forward_s) - (r.ttft_s - r.forward_s) for k, r in _cold_pairs(results)]
    return float(np.median(cold)) if cold else None


def headline_ratios(results: Sequence[RequestResult]) -> dict[str, Any]:
    """Ratios at the request with the longest restored prefix in the kvpool mode (the same
    request index in every mode): recompute TTFT / mode TTFT, and file-per-chunk TTFT / kvpool
    TTFT (> 1 = kvpool faster); and ``miss_penalty`` over the cold requests (see
    ``miss_penalty``; < 1 = kvpool faster), with ``miss_penalty_cold_requests`` and
    ``miss_overhead_s`` (see ``miss_overhead_s``)."""
    modes = by_mode(results)
    kv = modes.get("kvpool")
    if not kv or "recompute" not in modes:
        return {}
    i = max(range(len(kv)), key=lambda j: (kv[j].cached_tokens, kv[j].prompt_tokens))
    rec = modes["recompute"][i].ttft_s

    def ttft(mode: str) -> float | None:
        rs = modes.get(mode)
        return rs[i].ttft_s if rs else None

    out: dict[str, Any] = {"at_request": kv[i].name, "prompt_tokens": kv[i].prompt_tokens,
                           "longest_prefix_tokens": kv[i].cached_tokens,
                           "ttft_recompute_s": rec}
    dram, ssd, fpc = ttft("kvpool"), ttft("kvpool-ssd"), ttft("file-per-chunk")
    if dram:
        out["ttft_dram_vs_recompute"] = rec / dram
    if ssd:
        out["ttft_ssd_vs_recompute"] = rec / ssd
    if fpc and dram:
        out["ttft_vs_file_per_chunk"] = fpc / dram
    if fpc and ssd:
        out["ttft_ssd_vs_file_per_chunk"] = fpc / ssd
    penalty = miss_penalty(results)
    if penalty is not None:
        out["miss_penalty"], out["miss_penalty_cold_requests"] = penalty
        out["miss_overhead_s"] = miss_overhead_s(results)
    return out


def render(summary: dict[str, dict[str, Any]], ratios: dict[str, Any], console: Console) -> None:
    table = Table(title="kvpool demo: the same requests in every mode")
    for col in ("mode", "TTFT p50", "TTFT p99", "prefill tok/s", "e2e tok/s", "hit rate",
                "chunk hits by tier", "speedup on hits", "same tokens"):
        table.add_column(col, justify="left" if col in ("mode", "chunk hits by tier") else "right")
    for mode, s in summary.items():
        speed = s["median_speedup_on_hits"]
        table.add_row(mode, f"{s['ttft_p50_s'] * 1e3:,.0f} ms", f"{s['ttft_p99_s'] * 1e3:,.0f} ms",
                      f"{s['prefill_tokens_per_s']:,.0f}", f"{s['e2e_tokens_per_s']:.1f}",
                      f"{s['hit_rate']:.0%}",
                      ", ".join(f"{k} {v}" for k, v in s["chunk_hits_by_tier"].items()) or "-",
                      f"{speed:.1f}x" if speed else "-",
                      "yes" if s["outputs_identical"] else "[bold red]NO[/]")
    console.print(table)
    if ratios:
        console.print(f"At the longest prefix ({ratios['longest_prefix_tokens']:,} of "
                      f"{ratios['prompt_tokens']:,} prompt tokens restored, request "
                      f"{ratios['at_request']!r}; recompute TTFT "
                      f"{ratios['ttft_recompute_s']:.2f} s):")
        for key in ("ttft_dram_vs_recompute", "ttft_ssd_vs_recompute", "ttft_vs_file_per_chunk",
                    "ttft_ssd_vs_file_per_chunk"):
            if key in ratios:
                console.print(f"  {key:30s} {ratios[key]:6.1f}x")
        if "miss_penalty" in ratios:
            console.print(f"On the {ratios['miss_penalty_cold_requests']} cold requests "
                          "(nothing restored in the kvpool mode), kvpool / recompute TTFT, "
                          "median:")
            console.print(f"  {'miss_penalty':30s} {ratios['miss_penalty']:6.2f}x "
                          f"(target {MISS_PENALTY_TARGET})")
            console.print(f"  {'miss_overhead_s':30s} {ratios['miss_overhead_s'] * 1e3:6.1f} ms "
                          "(kvpool's own time before the first token, outside the forward)")


def chart(results: Sequence[RequestResult], path: Path) -> Path:
    """Grouped bars of TTFT per request and mode (log scale), saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = by_mode(results)
    names = [r.name for r in next(iter(modes.values()))]
    width = 0.8 / len(modes)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.55 * len(names) * len(modes) / 2), 5))
    for k, (mode, rs) in enumerate(modes.items()):
        xs = np.arange(len(rs)) + k * width
        ax.bar(xs, [r.ttft_s for r in rs], width, label=mode)
    ax.set_yscale("log")
    ax.set_ylabel("time to first token (s, log scale)")
    ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2)
    ax.set_xticklabels(names, rotation=60, ha="right", fontsize=8)
    ax.legend()
    ax.set_title("TTFT per request: recompute vs kvpool tiers vs file per chunk")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
