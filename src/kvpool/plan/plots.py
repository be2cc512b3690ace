"""PNG charts of a plan: hit rate vs DRAM size per policy with Belady; TTFT p99 and cost per
million prompt tokens vs DRAM size. matplotlib comes with the ``hf`` extra and is imported
only here, when plots are asked for."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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


#: Marker shapes, drawn hollow and shrinking per series so that series which coincide (two
#: policies with equal hit rates) still show as nested shapes.
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "p", "h", "*")
CHARTS = (("hit_rate.png", "chunk_hit_rate", "chunk hit rate"),
          ("ttft_p99.png", "ttft_p99_s", "TTFT p99 (s)"),
          ("cost_per_mtok.png", "usd_per_mtok", "$ per million prompt tokens"))


def series_style(i: int) -> dict[str, Any]:
    """Colour, marker and size of the ``i``-th series: the first 20 series get 20 distinct
    colours (tab20: the dark shade of its 10 hues, then the light one) and every pair of
    series within 12 x 20 differs in colour or marker."""
    from matplotlib import colormaps
    colour = colormaps["tab20"]((2 * i) % 20 + (i // 10) % 2)
    return {"color": colour, "marker": MARKERS[i % len(MARKERS)],
            "markersize": 10.0 - 1.5 * (i % 4), "markerfacecolor": "none",
            "markeredgewidth": 1.4}


def figure(result: dict[str, Any], key: str, ylabel: str) -> Any:
    """One chart of ``key`` vs DRAM size (in % of the trace's distinct chunks): a line per
    policy and SSD size (solid: DRAM only, dashed: with an SSD), Belady, and for TTFT and cost
    the no-cache level; the legend right of the axes, outside the data. Returns the matplotlib
    figure. Raises RuntimeError without matplotlib."""
    plt = _import_pyplot()
    distinct = float(max(1, int(result["trace"]["distinct_chunks"])))

    def pct(chunks: int) -> float:
        return 100.0 * chunks / distinct

    series: dict[str, list[dict[str, Any]]] = {}
    for r in result["rows"]:
        label = r["policy"] + (f", SSD {r['ssd']}" if r["ssd_bytes"] else "")
        series.setdefault(label, []).append(r)
    belady = sorted(result["belady"], key=lambda b: b["dram_chunks"])
    fig, ax = plt.subplots(figsize=(10, 5))
    for i, (label, rows) in enumerate(series.items()):
        rows = sorted(rows, key=lambda r: r["dram_chunks"])
        ax.plot([pct(r["dram_chunks"]) for r in rows], [r[key] for r in rows],
                linestyle="--" if rows[0]["ssd_bytes"] else "-", label=label,
                **series_style(i))
    ax.plot([pct(b["dram_chunks"]) for b in belady], [b[key] for b in belady], color="black",
            linestyle=":", linewidth=2, marker="x", label="Belady (DRAM only)")
    if key != "chunk_hit_rate":
        ax.axhline(result["no_cache"][key], color="grey", linestyle="-.", label="no cache")
    ax.set_xlabel("DRAM size (% of the trace's distinct chunks)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{result['trace']['name']}: {ylabel}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    return fig


def write_plots(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write the three charts (``CHARTS``) into ``out_dir``; returns their paths. Raises
    RuntimeError without matplotlib, OSError if a file cannot be written."""
    plt = _import_pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, key, ylabel in CHARTS:
        fig = figure(result, key, ylabel)
        path = out_dir / name
        try:
            fig.savefig(path, dpi=110, bbox_inches="tight")
        finally:
            plt.close(fig)
        paths.append(path)
    return paths
