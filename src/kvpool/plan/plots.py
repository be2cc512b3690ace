"""PNG charts of a plan: hit rate vs DRAM size per policy with Belady; TTFT p99 and cost per
million prompt tokens vs DRAM size. matplotlib comes with the ``hf`` extra and is imported
only here, when plots are asked for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

FILES = ("hit_rate.png", "ttft_p99.png", "cost_per_mtok.png")


def _import_pyplot() -> Any:
    """Raises RuntimeError, with the install command, when matplotlib is absent."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install 'kvpool[hf]' (or "
                           "pip install matplotlib)") from exc
    return plt


def write_plots(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write the three charts into ``out_dir``; returns their paths. The x axis is the DRAM
    size in % of the trace's distinct chunks; one line per policy and SSD size. Raises
    RuntimeError without matplotlib, OSError if a file cannot be written."""
    plt = _import_pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    distinct = float(max(1, int(result["trace"]["distinct_chunks"])))

    def pct(chunks: int) -> float:
        return 100.0 * chunks / distinct

    series: dict[str, list[dict[str, Any]]] = {}
    for r in result["rows"]:
        label = r["policy"] + (f", SSD {r['ssd']}" if r["ssd_bytes"] else "")
        series.setdefault(label, []).append(r)
    belady = sorted(result["belady"], key=lambda b: b["dram_chunks"])
    paths = []
    for name, key, ylabel in (("hit_rate.png", "chunk_hit_rate", "chunk hit rate"),
                              ("ttft_p99.png", "ttft_p99_s", "TTFT p99 (s)"),
                              ("cost_per_mtok.png", "usd_per_mtok", "$ per million prompt tokens")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, rows in series.items():
            rows = sorted(rows, key=lambda r: r["dram_chunks"])
            ax.plot([pct(r["dram_chunks"]) for r in rows], [r[key] for r in rows], marker="o",
                    label=label)
        ax.plot([pct(b["dram_chunks"]) for b in belady], [b[key] for b in belady], "k--",
                marker="x", label="Belady (DRAM only)")
        if key != "chunk_hit_rate":
            ax.axhline(result["no_cache"][key], color="grey", linestyle=":", label="no cache")
        ax.set_xlabel("DRAM size (% of the trace's distinct chunks)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{result['trace']['name']}: {ylabel}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
