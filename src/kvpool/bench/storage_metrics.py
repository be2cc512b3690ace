"""Metrics-overhead case of ``kvpool bench storage``: the same KVPool calls with the latency
histograms on (``metrics.enabled: true``, the default) and off, on the fastest path
(DRAM-resident 64 KiB chunks, where a fixed per-call cost weighs most). One DRAM-only pool
serves both sides (``KVPool.record_latency`` switches between passes), so both read the same
memory, and the passes alternate so machine noise hits both; counters cost nothing at call
time (they are read at scrape time), so this is the whole cost. kvpool's side is metrics on,
the reference off: a ratio below 1 is the metrics' cost. Every pass checks its last chunk
byte for byte.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvpool.bench.stats import BenchFailure, Comparison, PassResult, Timing
from kvpool.bench.storage_common import MiB, Run, aligned_view, fresh_keys, namespace_for
from kvpool.config import config_from_dict
from kvpool.keys import Namespace
from kvpool.pool import KVPool

METRICS_BATCH = 16  # chunks per get_many_into / lookup
METRICS_CASES = ("get_into", f"get_many_into {METRICS_BATCH}", f"lookup {METRICS_BATCH}")


def bench_metrics(run: Run) -> None:
    plan, size = run.plan, run.plan.small_size
    n = 256  # 16 MiB of chunks, resident in DRAM
    ops = max(100, plan.prefix_pass_bytes // size)  # calls per pass
    keys = fresh_keys(n)
    views = [run.src.chunk(size, 7 * i + 3) for i in range(n)]
    ns = namespace_for(size)
    cfg = config_from_dict({
        "cache_dir": str(run.scratch / "pool-metrics"),
        "dram": {"capacity": max(64 * MiB, 2 * n * size), "slab_size": plan.dram_slab},
        "ssd": {"enabled": False}})
    with KVPool(cfg, remote=False) as pool:  # one pool: the same memory on both sides
        pool.register_namespace(ns)
        if pool.put_many(ns, keys, views) != n:
            raise BenchFailure("pool put_many did not store every chunk")
        run.log(f"metrics: {ops} calls per pass on {n} DRAM-resident chunks, on vs off")
        outs = [aligned_view(size) for _ in range(METRICS_BATCH)]
        for case in METRICS_CASES:
            single = case == "get_into"
            per_op = size if single else size * METRICS_BATCH  # lookup: the bytes it finds
            timings = {enabled: Timing(per_op) for enabled in (True, False)}
            # the chunk the pass's last call put in outs[0]
            last = (ops - 1) % n if single else (ops - 1) % (n // METRICS_BATCH) * METRICS_BATCH
            call = _call(case, pool, ns, keys, outs)
            for _ in range(plan.repeats):
                for enabled in (True, False):
                    pool.record_latency(enabled)
                    outs[0][:] = bytes(size)  # a pass that read nothing cannot pass the check
                    timings[enabled].add(_pass(call, ops))
                    if not case.startswith("lookup"):
                        run.verify("pool get", outs[0], views[last])
            run.add(Comparison("metrics", case, size, 1, timings[True], timings[False],
                               "same pool, latency metrics off",
                               note="DRAM-resident chunks; the same pool with its latency "
                                    "histograms on (kvpool) and off, passes alternating",
                               extra={} if single else {"prefix_chunks": METRICS_BATCH}))


def _call(case: str, pool: KVPool, ns: Namespace, keys: list[bytes],
          outs: list[memoryview]) -> Callable[[int], bool]:
    n = len(keys)
    if case == "get_into":
        return lambda i: pool.get_into(ns, keys[i % n], outs[0])
    batch = [keys[j:j + METRICS_BATCH] for j in range(0, n, METRICS_BATCH)]
    if case.startswith("get_many_into"):
        return lambda i: all(pool.get_many_into(ns, batch[i % len(batch)], outs))
    return lambda i: pool.lookup(ns, batch[i % len(batch)]) == METRICS_BATCH


def _pass(call: Callable[[int], bool], ops: int) -> PassResult:
    lat, fails = [], 0
    start = time.perf_counter()
    for i in range(ops):
        t0 = time.perf_counter()
        fails += not call(i)
        lat.append(time.perf_counter() - t0)
    return PassResult(lat, time.perf_counter() - start, ops, fails)
