"""Pool-level write cases of ``kvpool bench storage``: what an engine's save costs through
``KVPool`` (the write-behind queue in front of the SSD engine), flushed to the disk, beside a
reference that writes the same bytes.

* ``pool write`` (``pool_ssd_write_vs_raw``): an SSD-only ``KVPool`` in cache mode (no DRAM
  tier: every put goes through the SSD's write-behind queue), ``put_many`` of batches of
  ``plan.batch`` chunks of 1 MiB, then ``flush`` (the pass ends once every byte is written),
  vs raw ``os.pwritev`` with O_DIRECT of the same bytes, one call per chunk, at fresh offsets
  of one preallocated file. The pool's background threads run at the bench's own priority
  (``pool.background_nice: 0``): the default +10, meant to leave an engine's threads the
  cores, starves the write-behind on a busy machine and measures the scheduler instead.
  ``info["pool_write_costs_us"]`` prices, per chunk, what the pool
  does that the raw side does not: the copy into staging (on the caller's thread, the GIL
  released), the xxh3 checksum and the record header (on the queue's thread).
* ``small pool write`` (``small_write_vs_file_per_chunk``): the same pool path on 64 KiB chunks
  (the default DRAM + SSD pool would publish in DRAM and queue the slot pinned; the SSD-only
  pool is the one that must write every byte), flushed at the end of each pass, vs
  ``FilePerChunkStore.put`` of the same chunks (one buffered file each, no fsync: its bytes
  may still sit in the page cache when its pass ends, ours are on the disk).

Failure contract: a dropped put or a short raw write fails the bench (BenchFailure).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import xxhash

from kvpool.bench.stats import BenchFailure, Comparison, PassResult, Timing, human_bytes, run_pass
from kvpool.bench.storage_common import MiB, Run, aligned_view, engine_capacity, fresh_keys
from kvpool.bench.storage_common import namespace_for as bench_namespace
from kvpool.bench.storage_ssd import RawFile
from kvpool.buffers import copy_into
from kvpool.config import config_from_dict
from kvpool.keys import Namespace
from kvpool.peers.file_per_chunk import FilePerChunkStore
from kvpool.pool import KVPool

POOL_WRITE_SIZE = MiB


def _pool(run: Run, path: Path, size: int, records: int, pass_bytes: int) -> KVPool:
    """An SSD-only cache-mode pool whose staging holds a whole pass (nothing is dropped)."""
    plan = run.plan
    room = max(256 * MiB, 2 * pass_bytes)
    return KVPool(config_from_dict({
        "cache_dir": str(path), "dram": {"capacity": 0},
        "ssd": {"capacity": engine_capacity(plan, size, records),
                "segment_size": plan.segment_size, "durability": "cache"},
        # background_nice 0: the queue's writer runs at the priority of the raw writer it is
        # compared with (at the default +10 a loaded machine starves it: 0.29 vs 1.26 here)
        "pool": {"write_behind_bytes": room, "save_budget_bytes": room,
                 "write_behind_batch": plan.batch, "warm_start_fraction": 0,
                 "background_nice": 0},
        "metrics": {"enabled": False}, "log": {"configure": False}}), remote=False,
        serve_metrics=False)


def _pool_pass(pool: KVPool, ns: Namespace, keys: Sequence[bytes],
               views: Sequence[memoryview], batch: int) -> PassResult:
    """put_many per batch, then flush; the wall time includes the flush."""
    lat: list[float] = []
    fails = 0
    clock = time.perf_counter
    start = clock()
    for j in range(0, len(keys), batch):
        part = keys[j:j + batch]
        t0 = clock()
        stored = pool.put_many(ns, part, views[j:j + batch])
        lat.extend([(clock() - t0) / len(part)] * len(part))  # per chunk
        fails += len(part) - stored
    if not pool.flush(600):
        raise BenchFailure("the pool's write-behind did not drain within 600 s")
    written = pool.stats()["write_behind"]
    if written["write_errors"]:
        raise BenchFailure(f"{written['write_errors']} pool writes failed")
    return PassResult(lat, clock() - start, len(keys), fails)


def _costs_us(size: int, reps: int = 20) -> dict[str, float]:
    """Median µs per chunk of ``size`` of the pool's own CPU work: the staging copy and the
    payload checksum."""
    src, dst = aligned_view(size), aligned_view(size)
    np.frombuffer(src, np.uint8)[:] = 7
    copies, sums = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        copy_into(dst, src)
        t1 = time.perf_counter()
        xxhash.xxh3_64_intdigest(src)
        t2 = time.perf_counter()
        copies.append(t1 - t0)
        sums.append(t2 - t1)
    return {"staging_copy": float(np.median(copies)) * 1e6,
            "checksum": float(np.median(sums)) * 1e6}


def bench_pool_write(run: Run) -> None:
    """``pool write`` 1 MiB: SSD-only KVPool put_many + flush vs raw O_DIRECT pwritev."""
    plan = run.plan
    size = POOL_WRITE_SIZE
    n = plan.chunks(size, plan.ssd_pass_bytes)
    passes = plan.repeats + 1
    ns = bench_namespace(size)
    keys = [fresh_keys(n) for _ in range(passes)]
    views = [[run.src.chunk(size, p * n + i) for i in range(n)] for p in range(passes)]
    kv, ref = Timing(size), Timing(size)
    raw = RawFile(run.scratch / "raw-pool-w.bin", passes * n * size)
    run.log(f"pool write: {n} chunks of {human_bytes(size)} per pass")
    try:
        with _pool(run, run.scratch / "pool-w", size, passes * n, n * size) as pool:
            pool.register_namespace(ns)

            def kv_pass(p: int) -> PassResult:
                return _pool_pass(pool, ns, keys[p], views[p], plan.batch)

            def ref_pass(p: int) -> PassResult:
                vs, base = views[p], p * n * size
                return run_pass(
                    lambda _t, i: os.pwritev(raw.wfd, [vs[i]], base + i * size) == size,
                    range(n))

            run.alternate(kv, ref, kv_pass, ref_pass, warmup=True)
    finally:
        raw.close()
        shutil.rmtree(run.scratch / "pool-w", ignore_errors=True)
    run.info["pool_write_costs_us"] = _costs_us(size)
    run.add(Comparison("pool", "write", size, 1, kv, ref, "raw O_DIRECT",
                       note=f"SSD-only KVPool, cache mode: put_many of {plan.batch}, then "
                            "flush; raw: one pwritev per chunk"))


def bench_small_pool_write(run: Run) -> None:
    """``small pool write``: the pool's save path on ``small_size`` chunks vs file per chunk."""
    plan = run.plan
    size, n, reps = plan.small_size, plan.small_chunks, plan.repeats
    ns = bench_namespace(size)
    keys = fresh_keys(n)
    views = [run.src.chunk(size, i) for i in range(n)]
    slices = [list(range(n * r // reps, n * (r + 1) // reps)) for r in range(reps)]
    fpc_dir = run.scratch / "fpc-pool"
    fpc = FilePerChunkStore(fpc_dir)
    kv, ref = Timing(size), Timing(size)
    try:
        with _pool(run, run.scratch / "pool-small", size, n, len(slices[0]) * size) as pool:
            pool.register_namespace(ns)
            for part in slices:
                kv.add(_pool_pass(pool, ns, [keys[i] for i in part],
                                  [views[i] for i in part], plan.batch))
                ref.add(run_pass(lambda _t, i: fpc.put(keys[i], views[i]), part))
    finally:
        fpc.close()
        shutil.rmtree(fpc_dir, ignore_errors=True)
        shutil.rmtree(run.scratch / "pool-small", ignore_errors=True)
    run.add(Comparison("small", "pool write", size, 1, kv, ref, "file per chunk",
                       note=f"KVPool put_many of {plan.batch} + flush (on disk) vs one "
                            "buffered file per chunk, no fsync"))
