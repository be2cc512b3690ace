"""Timing and reporting helpers shared by kvpool's benchmarks.

A *pass* runs a list of operations once, on one or more threads, and records every operation's
latency plus the pass's wall time. A case is measured over several passes; per-op figures
(median, p99) pool the latencies of all passes, throughput is the median over passes of
``ops / wall time`` (so several threads count as one aggregate throughput).

Every figure is shown beside a reference measured in the same run, with the ratio
``kvpool / reference`` of throughputs (> 1 means kvpool is faster).
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich import box
from rich.console import Console
from rich.table import Table

#: One operation: ``op(thread_no, item) -> ok``. ``item`` is whatever the pass's item list holds.
Op = Callable[[int, int], bool]


class BenchFailure(RuntimeError):
    """A benchmarked operation failed or returned wrong bytes; its figures would be meaningless."""


def run_in_work_dir(suite: str, work_dir: str | None, json_path: str | None,
                    run: Callable[[Path], dict[str, Any]],
                    show: Callable[[dict[str, Any]], None]) -> int:
    """The body of an engine bench's command: ``run(work)`` in ``work_dir`` (default: a temp
    dir, removed after), ``show`` the report, write it as JSON to ``json_path`` if given.
    Returns 0, or 2 after printing a BenchFailure (``kvpool bench <suite>: ...``)."""
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix=f"kvb-{suite}-"))
    try:
        report = run(work)
    except BenchFailure as exc:
        print(f"kvpool bench {suite}: {exc}", file=sys.stderr)
        return 2
    finally:
        if not work_dir:
            shutil.rmtree(work, ignore_errors=True)
    show(report)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=1) + "\n")
    return 0


@dataclass
class PassResult:
    """One pass: per-op latencies (seconds), wall time and how many ops returned False."""

    latencies: list[float]
    wall_s: float
    ops: int
    failures: int


def split(items: Sequence[int], parts: int) -> list[Sequence[int]]:
    """Contiguous, near-equal slices of ``items`` (some may be empty when parts > len)."""
    n = len(items)
    bounds = [n * i // parts for i in range(parts + 1)]
    return [items[bounds[i]:bounds[i + 1]] for i in range(parts)]


def run_pass(op: Op, items: Sequence[int], threads: int = 1) -> PassResult:
    """Run ``op`` once per item. With ``threads > 1`` the items are split into contiguous
    slices, one per Python thread, all released together by a barrier; the wall time runs from
    that release until the last thread finishes. One thread runs inline (no thread created).

    An exception raised by ``op`` in any thread is re-raised here after all threads stop.
    """
    if threads <= 1:
        lat: list[float] = []
        fails = 0
        clock = time.perf_counter
        t_start = clock()
        for item in items:
            t0 = clock()
            ok = op(0, item)
            lat.append(clock() - t0)
            if not ok:
                fails += 1
        wall = clock() - t_start
        return PassResult(lat, wall, len(items), fails)

    parts = split(items, threads)
    lats: list[list[float]] = [[] for _ in range(threads)]
    fail_counts = [0] * threads
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads + 1)

    def worker(t: int) -> None:
        clock = time.perf_counter
        mine = lats[t]
        fails = 0
        try:
            barrier.wait()
            for item in parts[t]:
                t0 = clock()
                ok = op(t, item)
                mine.append(clock() - t0)
                if not ok:
                    fails += 1
        except BaseException as exc:  # re-raised in the caller
            errors.append(exc)
        fail_counts[t] = fails

    pool = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(threads)]
    for th in pool:
        th.start()
    barrier.wait()
    t_start = time.perf_counter()
    for th in pool:
        th.join()
    wall = time.perf_counter() - t_start
    if errors:
        raise errors[0]
    flat = [x for sub in lats for x in sub]
    return PassResult(flat, wall, len(items), sum(fail_counts))


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100, linear interpolation); NaN for no values."""
    if not values:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def gb_per_s(nbytes: float, seconds: float) -> float:
    """Decimal GB/s (1e9 bytes per second); infinity for a zero duration."""
    return nbytes / seconds / 1e9 if seconds > 0 else math.inf


@dataclass
class Timing:
    """Several passes of the same case.

    ``bytes_per_op`` is the payload each op moves; ``items_per_op`` > 1 marks batched calls,
    whose latencies are per call and are divided by the batch size for the per-op figures.
    """

    bytes_per_op: int
    passes: list[PassResult] = field(default_factory=list)
    items_per_op: int = 1

    def add(self, result: PassResult) -> None:
        """Record a pass. Raises BenchFailure if any op in it failed."""
        if result.failures:
            raise BenchFailure(f"{result.failures} of {result.ops} operations failed")
        self.passes.append(result)

    @property
    def latencies(self) -> list[float]:
        return [x / self.items_per_op for p in self.passes for x in p.latencies]

    @property
    def median_s(self) -> float:
        return percentile(self.latencies, 50)

    @property
    def p99_s(self) -> float:
        return percentile(self.latencies, 99)

    @property
    def items_per_pass(self) -> int:
        return self.passes[0].ops * self.items_per_op if self.passes else 0

    @property
    def ops_per_s(self) -> float:
        """Median over passes of items per second of wall time (all threads together)."""
        rates = [p.ops * self.items_per_op / p.wall_s for p in self.passes if p.wall_s > 0]
        return float(np.median(rates)) if rates else math.nan

    @property
    def gb_per_s(self) -> float:
        return self.ops_per_s * self.bytes_per_op / 1e9

    def summary(self) -> dict[str, Any]:
        """JSON-ready figures: seconds per op, items/s and GB/s."""
        return {
            "median_s": self.median_s,
            "p99_s": self.p99_s,
            "ops_per_s": self.ops_per_s,
            "gb_per_s": self.gb_per_s,
            "bytes_per_op": self.bytes_per_op,
            "items_per_pass": self.items_per_pass,
            "passes": len(self.passes),
            "pass_wall_s": [p.wall_s for p in self.passes],
        }


@dataclass
class Comparison:
    """One table row: kvpool and its reference on the same bytes, same thread count."""

    group: str
    case: str
    chunk_bytes: int
    threads: int
    kvpool: Timing
    reference: Timing
    reference_name: str
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """kvpool throughput / reference throughput (> 1: kvpool faster)."""
        ref = self.reference.ops_per_s
        return self.kvpool.ops_per_s / ref if ref > 0 else math.nan

    def to_json(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "case": self.case,
            "chunk_bytes": self.chunk_bytes,
            "threads": self.threads,
            "kvpool": self.kvpool.summary(),
            "reference_name": self.reference_name,
            "reference": self.reference.summary(),
            "ratio": self.ratio,
            "note": self.note,
            **self.extra,
        }


def human_bytes(n: int) -> str:
    """1024-based size with a binary unit: 65536 -> '64 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:g} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def human_seconds(s: float) -> str:
    if math.isnan(s):
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.1f} µs"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def _rate(t: Timing) -> str:
    if t.bytes_per_op >= 1 << 20:
        return f"{t.gb_per_s:.2f} GB/s"
    return f"{t.ops_per_s / 1e3:.1f}k/s {t.gb_per_s:.2f} GB/s"


def _lat(t: Timing) -> str:
    return f"{human_seconds(t.median_s)} / {human_seconds(t.p99_s)}"


def _ratio_cell(r: float) -> str:
    if math.isnan(r):
        return "-"
    style = "green" if r >= 1.0 else ("yellow" if r >= 0.7 else "red")
    return f"[{style}]{r:.2f}x[/{style}]"


def render_table(rows: Sequence[Comparison], title: str, console: Console | None = None) -> None:
    """Print ``rows`` as one rich table: kvpool's median / p99 per op and throughput beside the
    reference's, and the throughput ratio kvpool / reference. Row notes become numbered
    footnotes under the table."""
    console = console or Console()
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  caption_justify="left")
    table.add_column("case")
    table.add_column("size", justify="right")
    table.add_column("thr", justify="right")
    table.add_column("kvpool p50 / p99", justify="right")
    table.add_column("kvpool", justify="right")
    table.add_column("reference")
    table.add_column("ref p50 / p99", justify="right")
    table.add_column("ref", justify="right")
    table.add_column("ratio", justify="right")
    notes: list[str] = []
    for row in rows:
        case = row.case
        if row.note:
            if row.note not in notes:
                notes.append(row.note)
            case += f" [dim]({notes.index(row.note) + 1})[/dim]"
        table.add_row(case, human_bytes(row.chunk_bytes), str(row.threads), _lat(row.kvpool),
                      _rate(row.kvpool), row.reference_name, _lat(row.reference),
                      _rate(row.reference), _ratio_cell(row.ratio))
    if notes:
        table.caption = "  ".join(f"({i}) {n}" for i, n in enumerate(notes, 1))
    console.print(table)
