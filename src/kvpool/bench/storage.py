"""``kvpool bench storage``: the DRAM tier and the SSD engine beside their references.

Every kvpool figure is printed beside a reference measured in the same run, on the same bytes,
with the same number of threads:

* DRAM: ``DramTier.put`` / ``get_into`` vs ``np.copyto`` into / out of a preallocated,
  pre-touched page-aligned arena of the same slot layout.
* SSD: ``SsdEngine.put`` / ``get_into`` vs raw ``os.pwritev`` / ``os.preadv`` with O_DIRECT
  of the same bytes (4 KiB-aligned mmap buffers) at offsets of one preallocated file in the
  same directory; sequential and random key order; 1 and 4 threads, where *4 threads* means 4
  Python threads each calling ``SsdEngine.get_into``/``put`` (and each calling
  ``os.preadv``/``os.pwritev`` for the reference). Extra "batched" rows show
  ``SsdEngine.get_many_into`` (the engine's own pool of ``io_threads=4``) against the same
  4-thread raw reads, and ``put_many`` against one raw ``pwritev`` per batch on one thread.
* Small chunks: ``SsdEngine`` vs :class:`~kvpool.peers.file_per_chunk.FilePerChunkStore` on
  the same 64 KiB chunks (50,000 in the full run), writes then cold reads.
* Prefixes: one ``get_many_into`` of 8, 16, 32 or 64 consecutive 64 KiB chunks saved by one
  ``put_many``, cold, vs the file-per-chunk store and one sequential O_DIRECT ``preadv`` of
  the same bytes (:mod:`kvpool.bench.storage_prefix`).
* Prefetch: the load of an SSD-only prefix a few ms after ``KVPool.lookup(prefetch=N)`` vs
  after a lookup without it (:mod:`kvpool.bench.storage_prefetch`).
* Metrics: KVPool calls on DRAM-resident chunks with metrics on vs off
  (:mod:`kvpool.bench.storage_metrics`).

Fairness rules: data is generated once (numpy random) and both sides write the very same
buffers; each write pass goes to fresh keys / fresh preallocated space on both sides (after one
untimed warm-up pass); the page cache is dropped (fdatasync + ``POSIX_FADV_DONTNEED``) before
every cold read pass; kvpool and reference passes alternate so machine noise hits both; every
read pass is checked byte-for-byte on the last chunk each thread read, plus a random sample,
so a broken read cannot look fast. Scratch files are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from kvpool.bench.stats import BenchFailure, Comparison, human_bytes, render_table
from kvpool.bench.storage_common import Log, MiB, Plan, Run, Source
from kvpool.bench.storage_dram import bench_dram
from kvpool.bench.storage_metrics import METRICS_CASES, bench_metrics
from kvpool.bench.storage_pool_write import (
    POOL_WRITE_SIZE,
    bench_pool_write,
    bench_small_pool_write,
)
from kvpool.bench.storage_prefetch import PREFETCH_CHUNKS, bench_prefetch
from kvpool.bench.storage_prefix import PREFIX_RATIOS, bench_prefix
from kvpool.bench.storage_small import bench_small
from kvpool.bench.storage_ssd import bench_ssd
from kvpool.record import BLOCK, round_up

__all__ = [
    "DEFAULT_DIR",
    "Plan",
    "StorageResult",
    "add_arguments",
    "main",
    "run_from_args",
    "run_storage_bench",
]

DEFAULT_DIR = Path("~/.cache/kvpool/bench")



def _dram_sizes(run: Run) -> None:
    for size in run.plan.sizes:
        bench_dram(run, size)


def _ssd_sizes(run: Run) -> None:
    for size in run.plan.sizes:
        bench_ssd(run, size)


#: The bench's cases, in the order a full run runs them (``--only`` picks some).
CASES: dict[str, Callable[[Run], None]] = {
    "dram": _dram_sizes,
    "ssd": _ssd_sizes,
    "small": bench_small,
    "small_pool_write": bench_small_pool_write,
    "pool_write": bench_pool_write,
    "prefix": bench_prefix,
    "prefetch": bench_prefetch,
    "metrics": bench_metrics,
}


# ---------------------------------------------------------------------------------- core
def _find(rows: Sequence[Comparison], group: str, case: str, size: int,
          threads: int) -> Comparison | None:
    for r in rows:
        if (r.group, r.case, r.chunk_bytes, r.threads) == (group, case, size, threads):
            return r
    return None


def _case_id(r: Comparison) -> str:
    return f"{r.group}/{r.case}/{r.chunk_bytes}/{r.threads}t"


@dataclass
class StorageResult:
    """``data`` is the JSON-ready result; ``rows`` the comparisons behind it (for tables)."""

    data: dict[str, Any]
    rows: list[Comparison]


def run_storage_bench(directory: str | os.PathLike[str], plan: Plan,
                      log: Log | None = None) -> StorageResult:
    """Run every case of ``plan`` in a fresh scratch directory under ``directory`` (removed
    afterwards). The result's ``data`` holds ``ratios`` (kvpool / reference throughput),
    ``ratio_basis`` (the case each ratio comes from), ``index_bytes_per_chunk``, ``cases``
    (every case's figures) and run details.

    ``plan.only`` names the cases to run (``CASES``; empty: all).

    Raises BenchFailure if an operation fails or returns wrong bytes, ValueError for a bad
    plan (an unknown case among them), OSError for an unusable directory.
    """
    plan.check()
    unknown = [name for name in plan.only if name not in CASES]
    if unknown:
        raise ValueError(f"unknown case(s) {unknown}; the cases are {list(CASES)}")
    say: Log = log or (lambda _msg: None)
    base = Path(directory).expanduser()
    base.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="kvpool-bench-", dir=base))
    t_start = time.perf_counter()
    try:
        needed = max(plan.small_chunks + plan.durable_chunks,
                     8 * plan.chunks(min(plan.sizes), plan.ssd_pass_bytes))
        src_bytes = min(256 * MiB, round_up(max(plan.sizes) + needed * BLOCK, MiB))
        src_bytes = max(src_bytes, 2 * max(plan.sizes), plan.small_size)
        say(f"generating {human_bytes(src_bytes)} of random data; scratch {scratch}")
        run = Run(plan, scratch, Source(src_bytes, plan.seed), say,
                   np.random.default_rng(plan.seed + 1))
        for name in plan.only or CASES:
            CASES[name](run)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    elapsed = time.perf_counter() - t_start

    h, top, small = plan.headline_size, max(plan.threads), plan.small_size
    basis = {
        "dram_get_vs_memcpy": ("dram", "get_into", h, 1),
        "dram_put_vs_memcpy": ("dram", "put", h, 1),
        "ssd_read_vs_raw": ("ssd", "read rand cold", h, top),
        "ssd_write_vs_raw": ("ssd", "write seq", h, top),
        "ssd_read_batched_vs_raw": ("ssd", "get_many_into cold", h, top),
        "ssd_write_batched_vs_raw": ("ssd", "put_many", h, 1),
        "small_read_vs_file_per_chunk": ("small", "read cold rand", small, 1),
        "small_write_vs_file_per_chunk": ("small", "pool write", small, 1),
        "small_engine_write_vs_file_per_chunk": ("small", "write", small, 1),
        "pool_ssd_write_vs_raw": ("pool", "write", POOL_WRITE_SIZE, 1),
        "small_read_4t_vs_file_per_chunk": ("small", "read cold rand", small, top),
        "small_write_durable_vs_file_per_chunk": ("small", "write durable", small, 1),
        "prefix_load_prefetch_vs_none": ("prefetch", f"load {PREFETCH_CHUNKS} after lookup",
                                         small, 1),
        **{f"metrics_on_vs_off_{case.split()[0]}": ("metrics", case, small, 1)
           for case in METRICS_CASES},
    }
    ratios: dict[str, float] = {}
    ratio_basis: dict[str, str] = {}
    for name, (g, c, s, t) in basis.items():
        row = _find(run.rows, g, c, s, t)
        if row is not None:
            ratios[name] = row.ratio
            ratio_basis[name] = _case_id(row)
    for name, reference in PREFIX_RATIOS.items():  # the worst prefix length stands for all
        prefix_rows = [r for r in run.rows if r.group == "prefix"
                       and r.reference_name == reference]
        if prefix_rows:
            worst = min(prefix_rows, key=lambda r: r.ratio)
            ratios[name] = worst.ratio
            ratio_basis[name] = _case_id(worst)
    data = {
        "suite": "storage",
        "quick": plan.quick,
        "elapsed_s": elapsed,
        "ratios": ratios,
        "ratio_basis": ratio_basis,
        "ratio_meaning": "kvpool throughput / reference throughput on the same bytes and "
                         "thread count; > 1 means kvpool is faster",
        "index_bytes_per_chunk": run.info.get("index_bytes_per_chunk", math.nan),
        "info": run.info,
        "plan": asdict(plan),
        "threads_mode": "N threads = N Python threads each calling the engine (and each "
                        "calling os.preadv/pwritev for the reference); get_many_into rows "
                        "use the engine's own io_threads=4 pool",
        "environment": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "directory": str(base),
        },
        "cases": [{"id": _case_id(r), **r.to_json()} for r in run.rows],
    }
    return StorageResult(data, run.rows)


# ---------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvpool bench storage``."""
    parser.add_argument("--quick", action="store_true",
                        help="small run (< 1 minute): fewer chunks per pass, 4,000 small chunks")
    parser.add_argument("--json", metavar="PATH", type=Path, default=None,
                        help="also write the results (ratios and every case) as JSON to PATH")
    parser.add_argument("--dir", metavar="PATH", type=Path, default=None,
                        help="scratch directory on the disk to test (a temporary directory "
                             f"is made inside it and removed); default {DEFAULT_DIR}")
    parser.add_argument("--repeats", metavar="N", type=int, default=None,
                        help="timed passes per case (default 3)")
    parser.add_argument("--only", metavar="CASE", action="append", choices=list(CASES),
                        default=None, help="run only this case (repeatable; default all): "
                                           + ", ".join(CASES))


def _print_report(res: StorageResult, console: Console) -> None:
    result, rows = res.data, res.rows
    plan = result["plan"]
    titles = {
        "dram": "DRAM tier vs np.copyto into/out of a preallocated arena (1 thread)",
        "ssd": "SSD engine vs raw O_DIRECT os.pwritev/os.preadv on one preallocated file",
        "small": (f"SSD engine vs file-per-chunk store: {plan['small_chunks']:,} chunks of "
                  f"{human_bytes(plan['small_size'])}"),
        "prefix": (f"SSD prefix reads, cold: one get_many_into of N consecutive "
                   f"{human_bytes(plan['small_size'])} chunks saved by one put_many, vs "
                   f"file-per-chunk and one sequential O_DIRECT preadv of the same bytes "
                   f"(1 thread; p50 / p99 per prefix)"),
    }
    for group, title in titles.items():
        group_rows = [r for r in rows if r.group == group]
        if group_rows:
            render_table(group_rows, title, console)
    console.print(f"threads: {result['threads_mode']}")
    info = result["info"]
    console.print(f"O_DIRECT: engine {info.get('ssd_direct_io')}, raw reference "
                  f"{info.get('raw_direct_io')}; index bytes per chunk "
                  f"{result['index_bytes_per_chunk']:.1f} "
                  f"({info.get('small_chunks_stored', 0):,} chunks indexed); file-per-chunk "
                  f"clear() took {info.get('file_per_chunk_clear_s', math.nan):.2f} s")
    console.print("ratios (kvpool / reference, > 1 = kvpool faster):")
    for name, value in result["ratios"].items():
        console.print(f"  {name:40s} {value:6.2f}x   [dim]{result['ratio_basis'][name]}[/dim]")
    console.print(f"total {result['elapsed_s']:.1f} s"
                  + (" (--quick)" if result["quick"] else ""))


def run_from_args(args: argparse.Namespace) -> int:
    """Run the bench as the CLI asked; 0 on success, 1 if a case failed, 2 for bad options."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # tables stay readable when piped or logged
    err = Console(stderr=True)
    plan = Plan.quick_plan() if args.quick else Plan.full()
    if args.repeats is not None:
        if args.repeats < 1:
            err.print("--repeats must be at least 1")
            return 2
        plan = replace(plan, repeats=args.repeats)
    if args.only:
        plan = replace(plan, only=tuple(dict.fromkeys(args.only)))
    directory = args.dir if args.dir is not None else DEFAULT_DIR
    try:
        result = run_storage_bench(
            directory, plan, log=lambda m: err.print(f"[dim]{m}[/dim]", soft_wrap=True))
    except BenchFailure as exc:
        err.print(f"[red]benchmark failed: {exc}[/red]")
        return 1
    except (OSError, ValueError) as exc:
        err.print(f"[red]cannot run the benchmark: {exc}[/red]")
        return 2
    _print_report(result, console)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.data, indent=2, default=str) + "\n")
        console.print(f"wrote {args.json}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_storage", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
