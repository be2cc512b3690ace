"""Prefetch case of ``kvpool bench storage``: what ``KVPool.lookup(prefetch=N)`` buys the load
that follows it. Prefixes of ``PREFETCH_CHUNKS`` chunks (``plan.small_size``) are saved
through a pool to its SSD and the pool is reopened, so every chunk is on SSD only (DRAM
empty). Each op is one request: ``lookup`` of the prefix, ``PREFETCH_GAP_S`` of the
caller's own work (a scheduler step between a lookup and its load), then one
``get_many_into`` of the prefix; only the load is timed. kvpool's side looks up with
``prefetch=PREFETCH_CHUNKS``, the reference without; each side reads its own prefixes (a
prefix read once is in DRAM), the two sides' passes alternate, every pass starts cold and
the background moves of an op (its prefetch, the load's promotions) finish, untimed, before
the next op starts. Each pass checks its last prefix byte for byte.
"""

from __future__ import annotations

import shutil
import time

from kvpool.bench.stats import BenchFailure, Comparison, PassResult, Timing
from kvpool.bench.storage_common import (
    MiB,
    Run,
    aligned_view,
    engine_capacity,
    files_under,
    fresh_keys,
    make_cold,
    namespace_for,
)
from kvpool.config import config_from_dict
from kvpool.keys import Namespace
from kvpool.pool import KVPool

PREFETCH_CHUNKS = 16  # one prefix, and the window asked for
PREFETCH_GAP_S = 0.002  # between the lookup and the load


def bench_prefetch(run: Run) -> None:
    """Prefix loads after a lookup with and without ``prefetch``."""
    plan, size, n = run.plan, run.plan.small_size, PREFETCH_CHUNKS
    count = max(2, plan.prefix_pass_bytes // (4 * n * size))  # prefixes per pass
    passes = [(side, r) for r in range(plan.repeats) for side in (True, False)]
    keys = {p: [fresh_keys(n) for _ in range(count)] for p in passes}
    total = len(passes) * count * n
    # every chunk its own bytes: a load that returned another prefix's chunk would show
    views = [[run.src.chunk(size, 13 * (i * n + j) + 7) for j in range(n)]
             for i in range(len(passes) * count)]
    slabs = -(-max(2 * total * size, 64 * MiB) // plan.dram_slab)
    run.log(f"prefetch: {count} prefixes of {n} chunks per pass, {PREFETCH_GAP_S * 1e3:g} ms "
            "from lookup to load")
    where = run.scratch / "pool-prefetch"
    cfg = config_from_dict({
        "cache_dir": str(where),
        "dram": {"capacity": slabs * plan.dram_slab, "slab_size": plan.dram_slab},
        "ssd": {"capacity": engine_capacity(plan, size, total),
                "segment_size": plan.segment_size},
        # no warm start: the case measures loads of prefixes only the SSD holds; staging for
        # the whole untimed fill, which outruns the SSD (a dropped save would fail the run)
        "pool": {"ssd_write": "through", "warm_start_fraction": 0,
                 "write_behind_bytes": max(256 * MiB, 2 * total * size)}})
    ns = namespace_for(size)
    try:
        with KVPool(cfg, remote=False) as pool:  # untimed: every prefix saved to SSD
            pool.register_namespace(ns)
            for i, ks in enumerate(ks for prefixes in keys.values() for ks in prefixes):
                if pool.put_many(ns, ks, views[i]) != n:
                    raise BenchFailure("pool put_many did not store every chunk")
            if not pool.flush(600):
                raise BenchFailure("the pool's saves to SSD did not finish")
        with KVPool(cfg, remote=False) as pool:  # reopened: DRAM empty
            pool.register_namespace(ns)
            outs = [aligned_view(size) for _ in range(n)]
            kv, ref = Timing(n * size), Timing(n * size)
            for k, (side, r) in enumerate(passes):
                make_cold(files_under(where))
                result = _pass(pool, ns, keys[(side, r)], outs, n if side else 0)
                (kv if side else ref).add(result)
                last = views[(k + 1) * count - 1]  # the pass's last prefix
                for j in range(n):
                    run.verify("pool get_many_into", outs[j], last[j])
            run.info["prefetched"] = pool.stats()["pool"]["prefetched"]
    finally:
        shutil.rmtree(where, ignore_errors=True)
    run.add(Comparison(
        "prefetch", f"load {n} after lookup", size, 1, kv, ref, "lookup without prefetch",
        note=f"SSD-only prefixes; lookup, {PREFETCH_GAP_S * 1e3:g} ms, then one "
             f"get_many_into; only the load timed; kvpool: lookup(prefetch={n})",
        extra={"prefix_chunks": n}))


def _pass(pool: KVPool, ns: Namespace, prefixes: list[list[bytes]], outs: list[memoryview],
          window: int) -> PassResult:
    lat, fails = [], 0
    for ks in prefixes:
        if pool.lookup(ns, ks, prefetch=window) != len(ks):
            raise BenchFailure("lookup did not find a saved prefix")
        time.sleep(PREFETCH_GAP_S)
        t0 = time.perf_counter()
        fails += not all(pool.get_many_into(ns, ks, outs))
        lat.append(time.perf_counter() - t0)
        if not pool.flush(60):  # untimed: no background move overlaps the next op
            raise BenchFailure("background moves did not finish")
    return PassResult(lat, sum(lat), len(prefixes), fails)
