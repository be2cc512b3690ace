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

Fairness rules: data is generated once (numpy random) and both sides write the very same
buffers; each write pass goes to fresh keys / fresh preallocated space on both sides (after one
untimed warm-up pass); the page cache is dropped (fdatasync + ``POSIX_FADV_DONTNEED``) before
every cold read pass; kvpool and reference passes alternate so machine noise hits both; every
read pass is checked byte-for-byte on the last chunk each thread read, plus a random sample,
so a broken read cannot look fast. Scratch files are removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import mmap
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from kvpool.bench.stats import (
    BenchFailure,
    Comparison,
    PassResult,
    Timing,
    human_bytes,
    render_table,
    run_pass,
    split,
)
from kvpool.keys import KVLayout, Namespace
from kvpool.peers.file_per_chunk import FilePerChunkStore
from kvpool.record import BLOCK, HEADER_BLOCK, record_size, round_up
from kvpool.ssd.engine import SsdEngine
from kvpool.tiers.dram import DramTier

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

DEFAULT_DIR = Path("~/.cache/kvpool/bench")


# ---------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class Plan:
    """What to run. ``quick()`` and ``full()`` are the CLI's two sizes; tests build tiny ones.

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
    headline_size: int = 2 * MiB
    segment_size: int = 256 * MiB
    dram_slab: int = 64 * MiB
    seed: int = 20261130
    quick: bool = False

    @classmethod
    def full(cls) -> Plan:
        return cls()

    @classmethod
    def quick_plan(cls) -> Plan:
        return cls(dram_pass_bytes=64 * MiB, ssd_pass_bytes=64 * MiB, min_chunks=8,
                   max_chunks=512, small_chunks=4_000, durable_chunks=300, quick=True)

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


def _keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def _namespace(size: int) -> Namespace:
    return Namespace(model="bench", layout=KVLayout(dtype="uint8", num_layers=1, num_kv_heads=1,
                                                    head_dim=size, chunk_tokens=1, kv_factor=1))


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


def _files_under(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if p.is_file()]


def _open_direct(path: Path, flags: int) -> tuple[int, bool]:
    """Open with O_DIRECT if the file system allows it (else buffered); (fd, direct)."""
    try:
        return os.open(path, flags | os.O_DIRECT), True
    except OSError:
        return os.open(path, flags), False


def _preallocated(path: Path, nbytes: int) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    finally:
        os.close(fd)


def _engine_capacity(plan: Plan, size: int, records: int) -> int:
    """Segments enough to hold ``records`` chunks of ``size`` without any eviction, plus two."""
    per_seg = (plan.segment_size - 2 * HEADER_BLOCK) // record_size(size)
    return (math.ceil(records / per_seg) + 2) * plan.segment_size


# ---------------------------------------------------------------------------------- runner
Log = Callable[[str], None]


@dataclass
class _Run:
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


# ---------------------------------------------------------------------------------- DRAM
def _bench_dram(run: _Run, size: int) -> None:
    plan = run.plan
    n = plan.chunks(size, plan.dram_pass_bytes)
    ns = _namespace(size)
    slot = round_up(size)
    capacity = round_up(n * slot, plan.dram_slab)
    run.log(f"DRAM {human_bytes(size)}: {n} chunks per pass, arena {human_bytes(capacity)}")
    dram = DramTier(capacity=capacity, slab_size=plan.dram_slab, eviction="lru")
    arena = as_array(aligned_view(n * slot))  # the reference's arena, pre-touched
    out = aligned_view(size)
    out_arr = as_array(out)
    passes = plan.repeats + 1
    keys = [_keys(n) for _ in range(passes)]
    views = [[run.src.chunk(size, p * n + i) for i in range(n)] for p in range(passes)]
    arrays = [[as_array(v) for v in vs] for vs in views]
    items = list(range(n))
    try:
        def ref_put(p: int) -> PassResult:
            vs = arrays[p]

            def op(_t: int, i: int) -> bool:
                np.copyto(arena[i * slot:i * slot + size], vs[i])
                return True
            return run_pass(op, items)

        # 1) slots reused: each pass's keys are deleted (untimed) before the next pass, so
        #    after the warm-up pass every put lands in an already touched slot, no eviction
        put_kv, put_ref = Timing(size), Timing(size)

        def kv_put(p: int) -> PassResult:
            ks, vs = keys[p], views[p]
            r = run_pass(lambda _t, i: dram.put(ks[i], ns, vs[i]), items)
            if p < passes - 1:
                for k in ks:
                    dram.delete(k)
            return r

        run.alternate(put_kv, put_ref, kv_put, ref_put, warmup=True)
        run.add(Comparison("dram", "put", size, 1, put_kv, put_ref, "np.copyto",
                           note="fresh keys into freed slots"))

        # 2) a full arena: every put of a fresh key evicts the least recently used chunk
        full_kv, full_ref = Timing(size), Timing(size)
        evict_keys = [_keys(n) for _ in range(plan.repeats)]

        def kv_put_full(p: int) -> PassResult:
            ks, vs = evict_keys[p], views[p]
            return run_pass(lambda _t, i: dram.put(ks[i], ns, vs[i]), items)

        run.alternate(full_kv, full_ref, kv_put_full, ref_put, warmup=False)
        run.add(Comparison("dram", "put evicting", size, 1, full_kv, full_ref, "np.copyto",
                           note="full arena, LRU"))
        # the evicting passes displaced the last put pass; put it back on both sides for the
        # reads (untimed)
        last = passes - 1
        for i in items:
            if not dram.put(keys[last][i], ns, views[last][i]):
                raise BenchFailure("dram put dropped a chunk")
        ref_put(last)

        last_keys, last_views = keys[-1], views[-1]
        get_kv, get_ref = Timing(size), Timing(size)

        def kv_get(_p: int) -> PassResult:
            r = run_pass(lambda _t, i: dram.get_into(last_keys[i], out), items)
            run.verify("dram get_into", out, last_views[-1])
            return r

        def ref_get(_p: int) -> PassResult:
            def op(_t: int, i: int) -> bool:
                np.copyto(out_arr, arena[i * slot:i * slot + size])
                return True
            r = run_pass(op, items)
            run.verify("reference copy", out, last_views[-1])
            return r

        run.alternate(get_kv, get_ref, kv_get, ref_get, warmup=False)
        for i in run.rng.choice(n, size=min(n, 4), replace=False).tolist():
            if not dram.get_into(last_keys[i], out):
                raise BenchFailure("dram get_into missed a chunk just written")
            run.verify("dram get_into (sample)", out, last_views[i])
        run.add(Comparison("dram", "get_into", size, 1, get_kv, get_ref, "np.copyto"))
    finally:
        dram.close()


# ---------------------------------------------------------------------------------- SSD
class _RawFile:
    """The raw reference: one preallocated file, chunk ``j`` of pass ``p`` at
    ``(p * n + j) * size``, written and read with O_DIRECT."""

    def __init__(self, path: Path, nbytes: int) -> None:
        self.path = path
        _preallocated(path, nbytes)
        self.wfd, self.direct = _open_direct(path, os.O_WRONLY)
        self.rfd, rdirect = _open_direct(path, os.O_RDONLY)
        self.direct = self.direct and rdirect

    def close(self) -> None:
        os.close(self.wfd)
        os.close(self.rfd)
        self.path.unlink(missing_ok=True)


@contextlib.contextmanager
def _engine(plan: Plan, path: Path, size: int, records: int,
            durability: str = "cache") -> Iterator[SsdEngine]:
    eng = SsdEngine(path=path, capacity=_engine_capacity(plan, size, records),
                    segment_size=plan.segment_size,
                    durability="durable" if durability == "durable" else "cache",
                    io_threads=4, direct_io="auto")
    try:
        yield eng
    finally:
        eng.close()
        shutil.rmtree(path, ignore_errors=True)


def _order(run: _Run, n: int, order: str) -> list[int]:
    return run.rng.permutation(n).tolist() if order == "rand" else list(range(n))


def _check_last(run: _Run, what: str, outs: Sequence[memoryview], views: Sequence[memoryview],
                items: Sequence[int], threads: int) -> None:
    """Each thread's output buffer must hold the chunk of the last item that thread read."""
    for t, part in enumerate(split(items, threads)):
        if part:
            run.verify(what, outs[t], views[part[-1]])


def _ssd_write_case(run: _Run, size: int, n: int, ns: Namespace, order: str,
                    threads: int) -> None:
    plan = run.plan
    passes = plan.repeats + 1
    items = _order(run, n, order)
    keys = [_keys(n) for _ in range(passes)]
    views = [[run.src.chunk(size, p * n + i) for i in range(n)] for p in range(passes)]
    kv, ref = Timing(size), Timing(size)
    raw = _RawFile(run.scratch / "raw-w.bin", passes * n * size)
    try:
        with _engine(plan, run.scratch / "ssd-w", size, passes * n) as eng:
            def kv_pass(p: int) -> PassResult:
                ks, vs = keys[p], views[p]
                return run_pass(lambda _t, i: eng.put(ks[i], ns, vs[i]), items, threads)

            def ref_pass(p: int) -> PassResult:
                vs, base = views[p], p * n * size
                return run_pass(
                    lambda _t, i: os.pwritev(raw.wfd, [vs[i]], base + i * size) == size,
                    items, threads)

            run.alternate(kv, ref, kv_pass, ref_pass, warmup=True)
            run.info.setdefault("ssd_direct_io", eng.direct_io)
    finally:
        raw.close()
    run.info.setdefault("raw_direct_io", raw.direct)
    run.add(Comparison("ssd", f"write {order}", size, threads, kv, ref,
                       "raw O_DIRECT", note="fresh space each pass, both sides"))


def _ssd_put_many_case(run: _Run, size: int, n: int, ns: Namespace) -> None:
    """put_many(batch) on one thread vs one raw pwritev of the same batch."""
    plan = run.plan
    passes = plan.repeats + 1
    b = min(plan.batch, n)
    nb = n // b
    batches = list(range(nb))
    groups = [[[(key, ns, run.src.chunk(size, p * n + j * b + i))
                for i, key in enumerate(_keys(b))] for j in batches] for p in range(passes)]
    kv, ref = Timing(size, items_per_op=b), Timing(size, items_per_op=b)
    raw = _RawFile(run.scratch / "raw-w.bin", passes * nb * b * size)
    try:
        with _engine(plan, run.scratch / "ssd-w", size, passes * nb * b) as eng:
            def kv_pass(p: int) -> PassResult:
                gs = groups[p]
                return run_pass(lambda _t, j: eng.put_many(gs[j]) == b, batches)

            def ref_pass(p: int) -> PassResult:
                iovs = [[v for _k, _ns, v in g] for g in groups[p]]
                base = p * nb * b * size
                return run_pass(
                    lambda _t, j: os.pwritev(raw.wfd, iovs[j], base + j * b * size) == b * size,
                    batches)

            run.alternate(kv, ref, kv_pass, ref_pass, warmup=True)
    finally:
        raw.close()
    run.add(Comparison("ssd", "put_many", size, 1, kv, ref, "raw, 1 pwritev/batch",
                       note=f"batches of {b}, one thread, seq"))


def _bench_ssd_reads(run: _Run, size: int, n: int, ns: Namespace) -> None:
    plan = run.plan
    max_threads = max(plan.threads)
    keys = _keys(n)
    views = [run.src.chunk(size, 7 * n + i) for i in range(n)]
    b = min(plan.batch, n)
    outs = [aligned_view(size) for _ in range(max(max_threads, b))]
    raw = _RawFile(run.scratch / "raw-r.bin", n * size)
    ssd_dir = run.scratch / "ssd-r"
    try:
        with _engine(plan, ssd_dir, size, n) as eng:
            # untimed setup: the same n chunks, written in key order on both sides
            if eng.put_many((keys[i], ns, views[i]) for i in range(n)) != n:
                raise BenchFailure("ssd put_many did not store every chunk")
            for i in range(n):
                if os.pwritev(raw.wfd, [views[i]], i * size) != size:
                    raise BenchFailure("raw pwritev was short")
            files = [*_files_under(ssd_dir), raw.path]

            def cold() -> None:
                drop_cache(files)

            def case(order: str, threads: int) -> Comparison:
                items = _order(run, n, order)
                kv, ref = Timing(size), Timing(size)

                def kv_pass(_p: int) -> PassResult:
                    r = run_pass(lambda t, i: eng.get_into(keys[i], outs[t]), items, threads)
                    _check_last(run, "ssd get_into", outs, views, items, threads)
                    return r

                def ref_pass(_p: int) -> PassResult:
                    r = run_pass(lambda t, i: os.preadv(raw.rfd, [outs[t]], i * size) == size,
                                 items, threads)
                    _check_last(run, "raw preadv", outs, views, items, threads)
                    return r

                run.alternate(kv, ref, kv_pass, ref_pass, warmup=False, before=cold)
                row = Comparison("ssd", f"read {order} cold", size, threads, kv, ref,
                                 "raw O_DIRECT")
                run.add(row)
                return row

            seq_top = None
            for order in ("seq", "rand"):
                for threads in plan.threads:
                    row = case(order, threads)
                    if order == "seq" and threads == max_threads:
                        seq_top = row

            # batched: get_many_into on the engine's own io_threads=4 pool, seq batches
            nb = n // b
            batches = list(range(nb))
            kvb = Timing(size, items_per_op=b)

            def batch_op(_t: int, j: int) -> bool:
                return all(eng.get_many_into(keys[j * b:(j + 1) * b], outs[:b]))

            for _ in range(plan.repeats):
                cold()
                kvb.add(run_pass(batch_op, batches))
                run.verify("ssd get_many_into", outs[b - 1], views[nb * b - 1])
            for i in run.rng.choice(n, size=min(n, 4), replace=False).tolist():
                if not eng.get_into(keys[i], outs[0]):
                    raise BenchFailure("ssd get_into missed a chunk just written")
                run.verify("ssd get_into (sample)", outs[0], views[i])
            if seq_top is not None:
                run.add(Comparison("ssd", "get_many_into cold", size, max_threads, kvb,
                                   seq_top.reference, "raw O_DIRECT",
                                   note=f"batches of {b} on the engine's io_threads=4 pool; "
                                        f"reference = the read seq {max_threads}-thread row"))
    finally:
        raw.close()


def _bench_ssd(run: _Run, size: int) -> None:
    n = run.plan.chunks(size, run.plan.ssd_pass_bytes)
    run.log(f"SSD {human_bytes(size)}: {n} chunks per pass ({human_bytes(n * size)})")
    ns = _namespace(size)
    for order in ("seq", "rand"):
        for threads in run.plan.threads:
            _ssd_write_case(run, size, n, ns, order, threads)
    _ssd_put_many_case(run, size, n, ns)
    _bench_ssd_reads(run, size, n, ns)


# ---------------------------------------------------------------------------------- small
def _bench_small(run: _Run) -> None:
    """SsdEngine vs FilePerChunkStore on the same ``small_chunks`` chunks of ``small_size``."""
    plan = run.plan
    size, n, reps = plan.small_size, plan.small_chunks, plan.repeats
    ns = _namespace(size)
    run.log(f"file-per-chunk peer: {n} chunks of {human_bytes(size)}")
    keys = _keys(n)
    views = [run.src.chunk(size, i) for i in range(n)]
    write_slices = [list(range(n * r // reps, n * (r + 1) // reps)) for r in range(reps)]
    perm: list[int] = run.rng.permutation(n).tolist()
    nread = len(plan.threads) * reps
    read_slices = [perm[n * k // nread:n * (k + 1) // nread] for k in range(nread)]
    outs = [aligned_view(size) for _ in range(max(plan.threads))]
    fpc_dir, ssd_dir = run.scratch / "fpc", run.scratch / "ssd-small"
    fpc = FilePerChunkStore(fpc_dir)
    try:
        with _engine(plan, ssd_dir, size, n) as eng:
            # writes: `reps` runs of n/reps fresh chunks each, alternating kvpool and the peer
            kv, ref = Timing(size), Timing(size)
            for part in write_slices:
                kv.add(run_pass(lambda _t, i: eng.put(keys[i], ns, views[i]), part))
                ref.add(run_pass(lambda _t, i: fpc.put(keys[i], views[i]), part))
            run.add(Comparison("small", "write", size, 1, kv, ref, "file per chunk",
                               note="no fsync on either side"))
            run.info["index_bytes_per_chunk"] = eng.index_bytes_per_chunk()
            run.info["small_chunks_stored"] = len(eng)
            seg_files = _files_under(ssd_dir)

            # cold reads: every run reads a disjoint random slice of all n chunks
            slices = iter(read_slices)
            for threads in plan.threads:
                kv, ref = Timing(size), Timing(size)
                for _ in range(reps):
                    part = next(slices)
                    run.info["small_cold_method"] = make_cold(seg_files)
                    kv.add(run_pass(lambda t, i: eng.get_into(keys[i], outs[t]), part, threads))
                    _check_last(run, "ssd get_into", outs, views, part, threads)
                    if not drop_system_caches():
                        fpc.drop_page_cache()
                    ref.add(run_pass(lambda t, i: fpc.get_into(keys[i], outs[t]), part,
                                     threads))
                    _check_last(run, "file-per-chunk get_into", outs, views, part, threads)
                run.add(Comparison("small", "read cold rand", size, threads, kv, ref,
                                   "file per chunk",
                                   note=f"{len(read_slices[0]):,} of {n:,} chunks per run"))
    finally:
        t0 = time.perf_counter()
        fpc.clear()
        fpc.close()
        run.info["file_per_chunk_clear_s"] = time.perf_counter() - t0
        shutil.rmtree(fpc_dir, ignore_errors=True)
    _bench_small_durable(run)


def _bench_small_durable(run: _Run) -> None:
    """Durable writes: fdatasync per put (kvpool) vs fsync per file (the peer)."""
    plan = run.plan
    size, nd, reps = plan.small_size, plan.durable_chunks, plan.repeats
    if nd < reps:
        return
    ns = _namespace(size)
    keys = _keys(nd)
    views = [run.src.chunk(size, plan.small_chunks + i) for i in range(nd)]
    fpc_dir = run.scratch / "fpc-durable"
    fpc = FilePerChunkStore(fpc_dir, durable=True)
    try:
        with _engine(plan, run.scratch / "ssd-durable", size, nd, durability="durable") as eng:
            kv, ref = Timing(size), Timing(size)
            for r in range(reps):
                part = list(range(nd * r // reps, nd * (r + 1) // reps))
                kv.add(run_pass(lambda _t, i: eng.put(keys[i], ns, views[i]), part))
                ref.add(run_pass(lambda _t, i: fpc.put(keys[i], views[i]), part))
            run.add(Comparison("small", "write durable", size, 1, kv, ref,
                               "file + fsync",
                               note=f"{nd:,} chunks; fdatasync per put vs fsync per file"))
    finally:
        fpc.close()
        shutil.rmtree(fpc_dir, ignore_errors=True)


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

    Raises BenchFailure if an operation fails or returns wrong bytes, ValueError for a bad
    plan, OSError for an unusable directory.
    """
    plan.check()
    say: Log = log or (lambda _msg: None)
    base = Path(directory).expanduser()
    base.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="kvpool-bench-", dir=base))
    t_start = time.perf_counter()
    try:
        needed = max(plan.small_chunks + plan.durable_chunks,
                     8 * plan.chunks(min(plan.sizes), plan.ssd_pass_bytes))
        src_bytes = min(256 * MiB, round_up(max(plan.sizes) + needed * BLOCK, MiB))
        src_bytes = max(src_bytes, 2 * max(plan.sizes, default=0), plan.small_size)
        say(f"generating {human_bytes(src_bytes)} of random data; scratch {scratch}")
        run = _Run(plan, scratch, Source(src_bytes, plan.seed), say,
                   np.random.default_rng(plan.seed + 1))
        for size in plan.sizes:
            _bench_dram(run, size)
        for size in plan.sizes:
            _bench_ssd(run, size)
        _bench_small(run)
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
        "small_write_vs_file_per_chunk": ("small", "write", small, 1),
        "small_read_4t_vs_file_per_chunk": ("small", "read cold rand", small, top),
        "small_write_durable_vs_file_per_chunk": ("small", "write durable", small, 1),
    }
    ratios: dict[str, float] = {}
    ratio_basis: dict[str, str] = {}
    for name, (g, c, s, t) in basis.items():
        row = _find(run.rows, g, c, s, t)
        if row is not None:
            ratios[name] = row.ratio
            ratio_basis[name] = _case_id(row)
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


def _print_report(res: StorageResult, console: Console) -> None:
    result, rows = res.data, res.rows
    plan = result["plan"]
    titles = {
        "dram": "DRAM tier vs np.copyto into/out of a preallocated arena (1 thread)",
        "ssd": "SSD engine vs raw O_DIRECT os.pwritev/os.preadv on one preallocated file",
        "small": (f"SSD engine vs file-per-chunk store: {plan['small_chunks']:,} chunks of "
                  f"{human_bytes(plan['small_size'])}"),
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
