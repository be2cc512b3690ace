"""The planner's tables (rich) and its JSON file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def _size(label: str, n: int) -> str:
    return f"{label} ({n / (1 << 30):,.1f} GiB)" if n else label


def _s(x: float) -> str:
    return f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s"


def print_report(result: dict[str, Any], console: Console) -> None:
    """Trace summary, one row per configuration, Belady per DRAM size, ratios, cheapest."""
    t = result["trace"]
    console.print(f"[bold]{t['name']}[/]: {t['requests']:,} requests, {t['references']:,} "
                  f"chunk references, {t['distinct_chunks']:,} distinct chunks of "
                  f"{t['block_tokens']} tokens ({result['chunk_bytes']:,} bytes at "
                  f"{result['bytes_per_token']:,} bytes/token"
                  + (f", {result['model']}" if result["model"] else "") + ")"
                  + (f"; {t['partial_chunks_not_stored']:,} partial last chunks never stored "
                     "(always prefilled)" if t.get("partial_chunks_not_stored") else ""))
    table = Table(title="replay per configuration (chunk hit rate = prefix chunks served; "
                        "req hit = mean share of a request's chunks served; vs Belady: over "
                        "Belady at the same capacity, D = DRAM, D+S = DRAM + SSD; engines = "
                        "prefill demand / trace span)")
    for col in ("policy", "DRAM", "SSD", "req hit", "chunk hit", "token hit",
                "vs Belady", "SSD WA", "TTFT p50", "TTFT p99", "engines", "$/Mtok", "replay"):
        table.add_column(col, justify="left" if col in ("policy", "DRAM", "SSD") else "right")
    for r in result["rows"]:
        vs = r["vs_belady"]
        basis = "D+S" if r.get("belady_basis") == "dram+ssd" else "D"
        table.add_row(r["policy"], _size(r["dram"], r["dram_bytes"]),
                      _size(r["ssd"], r["ssd_bytes"]), f"{r['request_hit_fraction']:.3f}",
                      f"{r['chunk_hit_rate']:.3f}", f"{r['token_hit_rate']:.3f}",
                      "-" if vs is None else f"{vs:.2f}x {basis}",
                      f"{r['ssd_write_amplification']:.3f}" if r["ssd_bytes"] else "-",
                      _s(r["ttft_p50_s"]), _s(r["ttft_p99_s"]), f"{r['engines']:.2f}",
                      f"{r['usd_per_mtok']:.4f}", f"{r['elapsed_s']:.2f} s")
    console.print(table)
    bel = Table(title="Belady (offline optimum, DRAM only)")
    for col in ("DRAM", "chunks", "req hit", "chunk hit", "token hit", "resident hit",
                "TTFT p99", "$/Mtok"):
        bel.add_column(col, justify="left" if col == "DRAM" else "right")
    for b in result["belady"]:
        bel.add_row(_size(b["dram"], b["dram_bytes"]), f"{b['dram_chunks']:,}",
                    f"{b['request_hit_fraction']:.3f}",
                    f"{b['chunk_hit_rate']:.3f}", f"{b['token_hit_rate']:.3f}",
                    f"{b['resident_hit_rate']:.3f}", _s(b["ttft_p99_s"]),
                    f"{b['usd_per_mtok']:.4f}")
    console.print(bel)
    _print_ssd(result, console)
    print_costs(result, console)
    for name, value in result["ratios"].items():
        b = result["ratio_basis"][name]
        console.print(f"{name}: [bold]{value:.3f}[/] ({b['policy']} "
                      f"{b['chunk_hit_rate']:.3f} / Belady {b['belady_chunk_hit_rate']:.3f} at "
                      f"{b['dram_chunks']:,} chunks)")
    for name, b in result.get("lru_ratio_basis", {}).items():
        console.print(f"{name}: [bold]{b['ratio']:.3f}[/] ({b['policy']} "
                      f"{b['chunk_hit_rate']:.3f} / lru {b['lru_chunk_hit_rate']:.3f} at "
                      f"{b['dram_chunks']:,} chunks)")
    target = result["ttft_p99_target_s"]
    if target is not None:
        best = result["cheapest"]
        if best is None:
            console.print(f"no configuration meets TTFT p99 <= {_s(target)}")
        else:
            console.print(f"cheapest meeting TTFT p99 <= {_s(target)}: policy {best['policy']}, "
                          f"DRAM {best['dram']}, SSD {best['ssd']}: "
                          f"{best['usd_per_mtok']:.4f} $/Mtok, p99 {_s(best['ttft_p99_s'])}")


def print_costs(result: dict[str, Any], console: Console) -> None:
    """The no-cache baseline, and what the cost figures are: measured or assumed."""
    base = result["no_cache"]
    console.print(f"no cache: TTFT p50 {_s(base['ttft_p50_s'])}, p99 {_s(base['ttft_p99_s'])}, "
                  f"{base['engines']:.2f} engines ({base['engines_whole']} whole), "
                  f"{base['usd_per_mtok']:.4f} $/Mtok")
    console.print(f"cost over {result['cost_span_s']:,.0f} s ({result['cost_span_source']}); "
                  f"engines paid for the prefill demand (tokens not served x s/token), tiers "
                  f"for the whole span; preset [bold]{result['cost_preset']}[/]:")
    model = result["cost_model"]
    for name, source in result["cost_sources"].items():
        console.print(f"  {name} = {model[name]:g}: {source}")


def _print_ssd(result: dict[str, Any], console: Console) -> None:
    """Per configuration with an SSD: its hit rate and bytes written per byte it served."""
    rows = [r for r in result["rows"] if r["ssd_bytes"]]
    if not rows:
        return
    s = result["settings"]
    ssd = Table(title=f"SSD wear (pool.ssd_write {s['ssd_write']}, ssd.admission "
                      f"{s['admission']}): bytes written per byte later hit from the SSD")
    for col in ("policy", "DRAM", "SSD", "SSD chunk hit", "chunk hit", "written/hit byte"):
        ssd.add_column(col, justify="left" if col in ("policy", "DRAM", "SSD") else "right")
    for r in rows:
        w = r["ssd_written_per_hit_byte"]
        ssd.add_row(r["policy"], r["dram"], r["ssd"], f"{r['ssd_chunk_hit_rate']:.3f}",
                    f"{r['chunk_hit_rate']:.3f}", "-" if w is None else f"{w:.2f}")
    console.print(ssd)


def write_json(result: dict[str, Any], path: Path) -> None:
    """Raises OSError if the file cannot be written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")


def print_routing(result: dict[str, Any], console: Console) -> None:
    """``kvpool plan --engines``: one row per routing policy, then the ratios."""
    s = result["settings"]
    table = Table(title=f"{result['trace']}: {result['requests']:,} requests over "
                        f"{s['engines']} engines (engine cache {s['engine_cache_chunks']:,}, "
                        f"host pool {s['host_pool_chunks']:,} chunks each; storage "
                        f"{s['storage_chunks']:,} shared; preset {result['cost_preset']})")
    for col in ("routing", "engine hit", "host hit", "storage hit", "TTFT p50", "TTFT p90",
                "TTFT p99", "load max/mean", "in flight per engine", "decisions"):
        table.add_column(col, justify="left" if col in ("routing", "decisions") else "right")
    for r in result["policies"]:
        table.add_row(r["policy"], f"{r['engine_cache_token_hit_rate']:.3f}",
                      f"{r['host_pool_token_hit_rate']:.3f}",
                      f"{r['storage_token_hit_rate']:.3f}", _s(r["ttft_p50_s"]),
                      _s(r["ttft_p90_s"]), _s(r["ttft_p99_s"]), f"{r['load_max_vs_mean']:.2f}",
                      " ".join(f"{x:.1f}" for x in r["load_in_flight"]),
                      ", ".join(f"{k} {v}" for k, v in sorted(r["decisions"].items())))
    console.print(table)
    load = result["offered_prefill_load"]
    console.print(f"offered prefill load (no cache) per engine: {load:.2f}"
                  + (" [bold red]> 1: the engines cannot keep up, TTFT is mostly queueing "
                     "(try a faster --preset or more --engines)[/]" if load > 1 else ""))
    for key in sorted(k for k in result if k.startswith("routing_")):
        console.print(f"{key} = {result[key]:.3f}")
