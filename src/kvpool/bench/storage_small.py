"""Small-chunk cases of ``kvpool bench storage``: ``SsdEngine`` vs
:class:`~kvpool.peers.file_per_chunk.FilePerChunkStore` on the same small chunks, writes then
cold random reads, and durable writes (fdatasync per put vs fsync per file)."""

from __future__ import annotations

import shutil
import time

from kvpool.bench.stats import Comparison, Timing, human_bytes, run_pass
from kvpool.bench.storage_common import (
    Run,
    aligned_view,
    check_last,
    drop_system_caches,
    files_under,
    fresh_keys,
    make_cold,
    namespace_for,
    open_engine,
)
from kvpool.peers.file_per_chunk import FilePerChunkStore


def bench_small(run: Run) -> None:
    """SsdEngine vs FilePerChunkStore on the same ``small_chunks`` chunks of ``small_size``."""
    plan = run.plan
    size, n, reps = plan.small_size, plan.small_chunks, plan.repeats
    ns = namespace_for(size)
    run.log(f"file-per-chunk peer: {n} chunks of {human_bytes(size)}")
    keys = fresh_keys(n)
    views = [run.src.chunk(size, i) for i in range(n)]
    write_slices = [list(range(n * r // reps, n * (r + 1) // reps)) for r in range(reps)]
    perm: list[int] = run.rng.permutation(n).tolist()
    nread = len(plan.threads) * reps
    read_slices = [perm[n * k // nread:n * (k + 1) // nread] for k in range(nread)]
    outs = [aligned_view(size) for _ in range(max(plan.threads))]
    fpc_dir, ssd_dir = run.scratch / "fpc", run.scratch / "ssd-small"
    fpc = FilePerChunkStore(fpc_dir)
    try:
        with open_engine(plan, ssd_dir, size, n) as eng:
            # writes: `reps` runs of n/reps fresh chunks each, alternating kvpool and the peer
            kv, ref = Timing(size), Timing(size)
            for part in write_slices:
                kv.add(run_pass(lambda _t, i: eng.put(keys[i], ns, views[i]), part))
                ref.add(run_pass(lambda _t, i: fpc.put(keys[i], views[i]), part))
            run.add(Comparison("small", "write", size, 1, kv, ref, "file per chunk",
                               note="no fsync on either side"))
            run.info["index_bytes_per_chunk"] = eng.index_bytes_per_chunk()
            run.info["small_chunks_stored"] = len(eng)
            seg_files = files_under(ssd_dir)

            # cold reads: every run reads a disjoint random slice of all n chunks
            slices = iter(read_slices)
            for threads in plan.threads:
                kv, ref = Timing(size), Timing(size)
                for _ in range(reps):
                    part = next(slices)
                    run.info["small_cold_method"] = make_cold(seg_files)
                    kv.add(run_pass(lambda t, i: eng.get_into(keys[i], outs[t]), part, threads))
                    check_last(run, "ssd get_into", outs, views, part, threads)
                    if not drop_system_caches():
                        fpc.drop_page_cache()
                    ref.add(run_pass(lambda t, i: fpc.get_into(keys[i], outs[t]), part,
                                     threads))
                    check_last(run, "file-per-chunk get_into", outs, views, part, threads)
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


def _bench_small_durable(run: Run) -> None:
    """Durable writes: fdatasync per put (kvpool) vs fsync per file (the peer)."""
    plan = run.plan
    size, nd, reps = plan.small_size, plan.durable_chunks, plan.repeats
    if nd < reps:
        return
    ns = namespace_for(size)
    keys = fresh_keys(nd)
    views = [run.src.chunk(size, plan.small_chunks + i) for i in range(nd)]
    fpc_dir = run.scratch / "fpc-durable"
    fpc = FilePerChunkStore(fpc_dir, durable=True)
    try:
        with open_engine(plan, run.scratch / "ssd-durable", size, nd, durability="durable") as eng:
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
