"""DRAM cases of ``kvpool bench storage``: ``DramTier.put`` / ``get_into`` vs ``np.copyto``
into / out of a preallocated, pre-touched page-aligned arena of the same slot layout."""

from __future__ import annotations

import numpy as np

from kvpool.bench.stats import BenchFailure, Comparison, PassResult, Timing, human_bytes, run_pass
from kvpool.bench.storage_common import Run, aligned_view, as_array, fresh_keys, namespace_for
from kvpool.record import round_up
from kvpool.tiers.dram import DramTier


def bench_dram(run: Run, size: int) -> None:
    plan = run.plan
    n = plan.chunks(size, plan.dram_pass_bytes)
    ns = namespace_for(size)
    slot = round_up(size)
    capacity = round_up(n * slot, plan.dram_slab)
    run.log(f"DRAM {human_bytes(size)}: {n} chunks per pass, arena {human_bytes(capacity)}")
    dram = DramTier(capacity=capacity, slab_size=plan.dram_slab, eviction="lru")
    arena = as_array(aligned_view(n * slot))  # the reference's arena, pre-touched
    out = aligned_view(size)
    out_arr = as_array(out)
    passes = plan.repeats + 1
    keys = [fresh_keys(n) for _ in range(passes)]
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
        evict_keys = [fresh_keys(n) for _ in range(plan.repeats)]

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
