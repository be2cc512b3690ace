"""Prefix cases of ``kvpool bench storage``: reading a prefix of 8, 16, 32 and 64 consecutive
chunks (``plan.small_size``, 64 KiB) that were saved by one ``put_many`` in prefix order, cold,
with one ``SsdEngine.get_many_into`` per prefix, beside two references reading the very same
chunks into the very same buffers on one thread:

* file per chunk: :class:`~kvpool.peers.file_per_chunk.FilePerChunkStore`, one
  ``get_into`` (open, read, close) per chunk of the prefix;
* sequential: one O_DIRECT ``os.preadv`` of the prefix's bytes (the chunks laid out back to
  back in one preallocated raw file, no headers), the floor of what one read can do.

Each pass reads every prefix once in a random order; the three sides' passes alternate and
every one starts cold (``make_cold``: page cache, dentries and inodes where permitted). One op
is one prefix: latencies and throughput are per prefix read. Each pass checks its last prefix
byte for byte and fails the run on any miss.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable

from kvpool.bench.stats import BenchFailure, Comparison, PassResult, Timing, human_bytes, run_pass
from kvpool.bench.storage_common import (
    Run,
    aligned_view,
    drop_system_caches,
    files_under,
    fresh_keys,
    make_cold,
    namespace_for,
    open_engine,
)
from kvpool.bench.storage_ssd import RawFile
from kvpool.keys import Namespace
from kvpool.peers.file_per_chunk import FilePerChunkStore
from kvpool.ssd.engine import SsdEngine

#: The ratios this group reports: the lowest over the prefix lengths, each with its case.
PREFIX_RATIOS = {"prefix_read_vs_file_per_chunk": "file per chunk",
                 "prefix_read_vs_sequential": "raw O_DIRECT, 1 preadv"}


def bench_prefix(run: Run) -> None:
    """Every prefix length of the plan, on one engine, one file-per-chunk store and one raw
    file (each prefix length its own chunks, written untimed before its reads)."""
    plan = run.plan
    size = plan.small_size
    counts = {n: max(2, plan.prefix_pass_bytes // (n * size)) for n in plan.prefix_lengths}
    total = sum(n * c for n, c in counts.items())
    run.log(f"prefix reads: {human_bytes(size)} chunks, prefixes of "
            f"{', '.join(map(str, plan.prefix_lengths))}; {total:,} chunks in all")
    ns = namespace_for(size)
    outs = [aligned_view(size) for _ in range(max(plan.prefix_lengths))]
    fpc_dir, ssd_dir = run.scratch / "fpc-prefix", run.scratch / "ssd-prefix"
    raw = RawFile(run.scratch / "raw-prefix.bin", total * size)
    fpc = FilePerChunkStore(fpc_dir)
    first = 0  # the raw file's chunk number of a prefix length's first chunk
    try:
        with open_engine(plan, ssd_dir, size, total) as eng:
            run.info["prefix_direct_io"] = {"engine": eng.direct_io, "raw": raw.direct}
            for n, count in counts.items():
                _prefix_case(run, eng, fpc, raw, n, count, first, outs, ns)
                first += n * count
            run.info["prefix_coalesced_reads"] = eng.stats()["coalesced_reads"]
    finally:
        t0 = time.perf_counter()
        fpc.clear()
        fpc.close()
        run.info["prefix_file_per_chunk_clear_s"] = time.perf_counter() - t0
        shutil.rmtree(fpc_dir, ignore_errors=True)
        raw.close()


def _prefix_case(run: Run, eng: SsdEngine, fpc: FilePerChunkStore, raw: RawFile, n: int,
                 count: int, first: int, outs: list[memoryview], ns: Namespace) -> None:
    """``count`` prefixes of ``n`` chunks: written, then read by the three sides in turn."""
    plan, size = run.plan, run.plan.small_size
    keys = [fresh_keys(n) for _ in range(count)]
    views = [[run.src.chunk(size, 11 * (first + p * n + j) + 5) for j in range(n)]
             for p in range(count)]
    for p in range(count):  # untimed: each prefix saved as one batch, in prefix order
        if eng.put_many([(keys[p][j], ns, views[p][j]) for j in range(n)]) != n:
            raise BenchFailure("ssd put_many did not store every chunk of a prefix")
        for j in range(n):
            if not fpc.put(keys[p][j], views[p][j]):
                raise BenchFailure("file-per-chunk put failed")
            if os.pwritev(raw.wfd, [views[p][j]], (first + p * n + j) * size) != size:
                raise BenchFailure("raw pwritev was short")
    files = [*files_under(run.scratch / "ssd-prefix"), raw.path]
    mine = outs[:n]

    def cold() -> None:
        make_cold(files)
        if not drop_system_caches():
            fpc.drop_page_cache()

    def kv_op(_t: int, p: int) -> bool:
        return all(eng.get_many_into(keys[p], mine))

    def fpc_op(_t: int, p: int) -> bool:
        ks = keys[p]
        return all([fpc.get_into(ks[j], mine[j]) for j in range(n)])

    def seq_op(_t: int, p: int) -> bool:
        return os.preadv(raw.rfd, mine, (first + p * n) * size) == n * size

    kv, ref_fpc, ref_seq = Timing(n * size), Timing(n * size), Timing(n * size)
    sides: list[tuple[Timing, Callable[[int, int], bool], str]] = [
        (kv, kv_op, "ssd get_many_into"), (ref_fpc, fpc_op, "file-per-chunk get_into"),
        (ref_seq, seq_op, "raw preadv")]
    for _ in range(plan.repeats):
        order: list[int] = run.rng.permutation(count).tolist()
        for timing, op, what in sides:
            cold()
            result: PassResult = run_pass(op, order)
            timing.add(result)
            last = order[-1]
            for j in range(n):
                run.verify(what, mine[j], views[last][j])
    note = (f"{count:,} prefixes of {n} x {human_bytes(size)} saved by one put_many each, "
            f"read cold in random order, one call per prefix; latency per prefix")
    run.add(Comparison("prefix", f"read {n} cold", size, 1, kv, ref_fpc, "file per chunk",
                       note=note, extra={"prefix_chunks": n}))
    run.add(Comparison("prefix", f"read {n} cold vs sequential", size, 1, kv, ref_seq,
                       "raw O_DIRECT, 1 preadv", note=note, extra={"prefix_chunks": n}))
