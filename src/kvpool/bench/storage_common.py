"""Shared pieces of ``kvpool bench storage``: the plan, the source data, cold caches, engine
construction and the run context that alternates and verifies passes.

They carry out the fairness rules listed in :mod:`kvpool.bench.storage`: the data is
generated once (:class:`Source`), caches are dropped before cold reads (:func:`make_cold`,
:func:`drop_cache`), kvpool and reference passes alternate (:meth:`Run.alternate`) and reads
are checked byte-for-byte (:meth:`Run.verify`, :func:`check_last`).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.bench.stats import BenchFailure, Comparison, PassResult, Timing, human_bytes, split
from kvpool.keys import KVLayout, Namespace
from kvpool.record import BLOCK, HEADER_BLOCK, record_size, round_up
from kvpool.ssd.engine import SsdEngine

KiB = 1 << 10
MiB = 1 << 20


# ---------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class Plan:
    """What to run. ``quick_plan()`` and ``full()`` are the CLI's two sizes; tests build tiny ones.

    Chunks per pass for a size ``s`` are ``clamp(pass_bytes // s, min_chunks, max_chunks)``.
    """

    sizes: tuple[int, ...] = (64 * KiB, 2 * MiB, 16 * MiB)
    repeats: int = 3
    dram_pass_bytes: int = 256 * MiB
    ssd_pass_bytes: int = 512 * MiB
    min_chunks: int = 16
    max_chunks: int = 4096
    threads: tuple[int, ...] = (1, 4)
    batch: int = 16
    small_size: int = 64 * KiB
    small_chunks: int = 50_000
    durable_chunks: int = 2_000
    prefix_lengths: tuple[int, ...] = (8, 16, 32, 64)
    prefix_pass_bytes: int = 256 * MiB
    headline_size: int = 2 * MiB
    segment_size: int = 256 * MiB
    dram_slab: int = 64 * MiB
    seed: int = 20261130
    quick: bool = False
    only: tuple[str, ...] = ()  # names of ``storage.CASES`` to run; empty: all

    @classmethod
    def full(cls) -> Plan:
        return cls()

    @classmethod
    def quick_plan(cls) -> Plan:
        return cls(dram_pass_bytes=64 * MiB, ssd_pass_bytes=64 * MiB, min_chunks=8,
                   max_chunks=512, small_chunks=4_000, durable_chunks=300,
                   prefix_pass_bytes=64 * MiB, quick=True)

    def chunks(self, size: int, pass_bytes: int) -> int:
        return max(self.min_chunks, min(self.max_chunks, pass_bytes // size))

    def check(self) -> None:
        """Raises ValueError for a plan that cannot run."""
        if self.repeats < 1:
            raise ValueError("repeats must be >= 1")
        for s in (*self.sizes, self.small_size):
            if s <= 0 or s % BLOCK:
                raise ValueError(f"chunk size {s} is not a positive multiple of {BLOCK}")
        if self.headline_size not in self.sizes:
            raise ValueError("headline_size must be one of sizes")
        if any(n < 1 for n in self.prefix_lengths):
            raise ValueError("prefix_lengths must be positive")
        if self.small_chunks < self.repeats * len(self.threads):
            raise ValueError("small_chunks must be >= repeats * len(threads)")
        if max(self.sizes) > self.dram_slab or max(self.sizes) + 2 * HEADER_BLOCK > \
                self.segment_size:
            raise ValueError("a chunk size exceeds dram_slab or segment_size")


# ---------------------------------------------------------------------------------- data
def aligned_view(nbytes: int) -> memoryview:
    """A page-aligned, writable byte view of an anonymous mmap (zero-filled, pre-touched)."""
    mm = mmap.mmap(-1, max(BLOCK, round_up(nbytes)))
    view = memoryview(mm)[:nbytes]
    as_array(view).fill(0)  # first-touch now, not inside a timed pass
    return view


def as_array(view: memoryview) -> np.ndarray:
    """The same bytes as a uint8 numpy array (no copy)."""
    return np.frombuffer(view, dtype=np.uint8)


class Source:
    """Random bytes generated once; chunk ``i`` of size ``s`` is the 4 KiB-aligned view at
    ``(i mod positions) * 4 KiB``, so chunks differ from each other (a read that returns the
    wrong chunk fails verification) and are all O_DIRECT-capable buffers."""

    def __init__(self, nbytes: int, seed: int) -> None:
        self.view = aligned_view(nbytes)
        self.data = as_array(self.view)
        rng = np.random.default_rng(seed)
        step = 16 * MiB
        for off in range(0, nbytes, step):
            n = min(step, nbytes - off)
            self.data[off:off + n] = np.frombuffer(rng.bytes(n), dtype=np.uint8)

    def chunk(self, size: int, i: int) -> memoryview:
        positions = (len(self.view) - size) // BLOCK + 1
        off = (i % positions) * BLOCK
        return self.view[off:off + size]


def fresh_keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def namespace_for(size: int) -> Namespace:
    return Namespace(model="bench", layout=KVLayout(dtype="uint8", num_layers=1, num_kv_heads=1,
                                                    head_dim=size, chunk_tokens=1, kv_factor=1))


# ---------------------------------------------------------------------------------- cache
def drop_cache(paths: Sequence[Path]) -> None:
    """Write back and evict each file's pages (fdatasync + POSIX_FADV_DONTNEED; no root)."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_system_caches() -> bool:
    """Write back, then drop page cache, dentries and inodes machine-wide (``echo 3 >
    /proc/sys/vm/drop_caches``; needs root). False where not permitted.

    A file-per-chunk store pays for directory and inode lookups on a cold read, which only
    this makes visible; a busy cache server with millions of chunk files cannot keep them all
    in the dentry cache, so this is the fair "cold" for that peer."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def make_cold(paths: Sequence[Path]) -> str:
    """Drop every cache the OS allows; returns the method used (reported in the JSON)."""
    if drop_system_caches():
        return "drop_caches=3 (page cache, dentries, inodes)"
    drop_cache(paths)
    return "posix_fadvise DONTNEED per file (dentries and inodes stay warm)"


def files_under(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if p.is_file()]


# ---------------------------------------------------------------------------------- engine
def engine_capacity(plan: Plan, size: int, records: int) -> int:
    """Segments enough to hold ``records`` chunks of ``size`` without any eviction, plus two."""
    per_seg = (plan.segment_size - 2 * HEADER_BLOCK) // record_size(size)
    return (math.ceil(records / per_seg) + 2) * plan.segment_size


@contextlib.contextmanager
def open_engine(plan: Plan, path: Path, size: int, records: int,
                durability: str = "cache") -> Iterator[SsdEngine]:
    eng = SsdEngine(path=path, capacity=engine_capacity(plan, size, records),
                    segment_size=plan.segment_size,
                    durability="durable" if durability == "durable" else "cache",
                    io_threads=4, direct_io="auto")
    try:
        yield eng
    finally:
        eng.close()
        shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------- runner
Log = Callable[[str], None]


@dataclass
class Run:
    """One run in progress: its plan, scratch directory, data, log, rows and extra info."""

    plan: Plan
    scratch: Path
    src: Source
    log: Log
    rng: np.random.Generator
    rows: list[Comparison] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def verify(self, what: str, got: memoryview, expected: memoryview) -> None:
        if not np.array_equal(as_array(got), as_array(expected)):
            raise BenchFailure(f"{what}: read-back bytes differ from what was written")

    def alternate(self, kv: Timing, ref: Timing, kv_pass: Callable[[int], PassResult],
                  ref_pass: Callable[[int], PassResult], warmup: bool,
                  before: Callable[[], None] | None = None) -> None:
        """Repeat: (before) kvpool pass, (before) reference pass. Pass 0 is an untimed warm-up
        when ``warmup``; the pass number is handed on so write passes can use fresh space."""
        first = 1 if warmup else 0
        for p in range(first + self.plan.repeats):
            for timing, fn in ((kv, kv_pass), (ref, ref_pass)):
                if before is not None:
                    before()
                result = fn(p)
                if p >= first:
                    timing.add(result)
                elif result.failures:
                    raise BenchFailure(f"{result.failures} warm-up operations failed")

    def add(self, row: Comparison) -> None:
        self.rows.append(row)
        self.log(f"  {row.group} {row.case} {human_bytes(row.chunk_bytes)} {row.threads}t: "
                 f"kvpool {row.kvpool.gb_per_s:.2f} GB/s, {row.reference_name} "
                 f"{row.reference.gb_per_s:.2f} GB/s -> {row.ratio:.2f}x")


def check_last(run: Run, what: str, outs: Sequence[memoryview], views: Sequence[memoryview],
               items: Sequence[int], threads: int) -> None:
    """Each thread's output buffer must hold the chunk of the last item that thread read."""
    for t, part in enumerate(split(items, threads)):
        if part:
            run.verify(what, outs[t], views[part[-1]])
