"""Belady's offline optimum for the DRAM tier: on a miss when full, evict the chunk whose next
use is furthest in the future (or keep the incoming chunk out, if its own next use is
furthest: a chunk never used again is never stored).

The trace is the flat reference stream of every request's chunks; next uses are precomputed
with one stable argsort (``next_use``), victims come from a heap with lazy deletion. It
maximises the references that find their chunk resident, so its ``resident`` hit rate bounds
the chunk hit rate of any policy at that capacity from above; its ``prefix`` hits (the leading
run a lookup would return, what the tiers serve) are what the report compares with.

No separate prefix-aware variant: in a trace of this format an id stands for its whole prefix,
so every request that references a chunk references all its ancestors before it, and an
ancestor's next use is never later than its descendant's. Belady thus already evicts
descendants first (tail-first, leaf-first); the only exception is a descendant due again later
in the request being replayed. On the synthetic trace its prefix and resident hit rates are
equal, so Belady's prefix hit rate is the optimum a prefix-aware policy could reach.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

import numpy as np

from kvpool.plan.trace import Trace


def next_use(keys: np.ndarray) -> np.ndarray:
    """For each position, the next position holding the same key; ``len(keys)`` if none."""
    n = keys.size
    order = np.argsort(keys, kind="stable")
    nxt = np.full(n, n, dtype=np.int64)
    if n > 1:
        same = keys[order[1:]] == keys[order[:-1]]
        nxt[order[:-1][same]] = order[1:][same]
    return nxt


@dataclass
class BeladyResult:
    capacity: int
    hits: np.ndarray  # per request: prefix chunks resident at the lookup
    hit_tokens: np.ndarray
    resident_hits: int  # references whose chunk was resident, prefix or not
    elapsed_s: float


def belady(trace: Trace, capacity: int, nxt: np.ndarray | None = None) -> BeladyResult:
    """Replay ``trace`` through a DRAM of ``capacity`` chunks under Belady. ``nxt`` may pass
    ``next_use(trace.keys)`` computed once for several capacities. Raises ValueError for a
    negative capacity."""
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0 chunks, got {capacity}")
    started = time.perf_counter()
    if nxt is None:
        nxt = next_use(trace.keys)
    never = trace.references
    keys, tokens, nexts = trace.keys.tolist(), trace.tokens.tolist(), nxt.tolist()
    starts = trace.starts.tolist()
    resident: dict[int, int] = {}  # key -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, key); stale entries skipped
    hits = np.zeros(trace.requests, dtype=np.int64)
    hit_tokens = np.zeros(trace.requests, dtype=np.int64)
    resident_hits = 0
    for j in range(trace.requests):
        s, e = starts[j], starts[j + 1]
        p = s
        while p < e and keys[p] in resident:
            p += 1
        hits[j] = p - s
        hit_tokens[j] = sum(tokens[s:p])
        for p in range(s, e):
            k, nu = keys[p], nexts[p]
            if k in resident:
                resident_hits += 1
                if nu == never:
                    del resident[k]  # never used again: its slot is free now
                else:
                    resident[k] = nu
                    heapq.heappush(heap, (-nu, k))
                continue
            if nu == never or capacity == 0:
                continue
            if len(resident) >= capacity:
                while True:
                    far, victim = heap[0]
                    if resident.get(victim) == -far:
                        break
                    heapq.heappop(heap)
                if -far < nu:
                    continue  # the incoming chunk is the furthest: keep it out
                heapq.heappop(heap)
                del resident[victim]
            resident[k] = nu
            heapq.heappush(heap, (-nu, k))
    return BeladyResult(capacity, hits, hit_tokens, resident_hits,
                        time.perf_counter() - started)
