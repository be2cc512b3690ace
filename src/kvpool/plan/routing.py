"""``kvpool plan --engines N --routing kv round_robin random``: a trace replayed across N
engines, each with its own engine prefix cache and kvpool host pool, over one shared storage
tier, under each routing policy of :mod:`kvpool.route.policy` (the objects ``kvpool route``
routes with).

Per request, in arrival order:

1. Each engine's in-flight requests that have finished by the arrival are retired.
2. The policy sees, per engine, the request's leading chunks split by the tier that holds them
   (engine cache, then host pool, then storage: the first chunk none holds ends the prefix)
   and the engine's requests in flight, and names an engine.
3. On that engine: chunks in its cache are read (``touch``); the rest of the request is put
   into its cache (LRU, as vLLM's prefix cache reuses its least recently freed blocks); chunks
   its host pool lacks (those loaded from storage and those computed) are put there (kvpool's
   DRAM policy); computed chunks are written through to storage (LRU), storage hits touched.
   The caches are updated at the decision, not when the prefill ends (a small optimism for
   requests that arrive within one prefill of each other, the same for every policy).
4. TTFT, from the planner's cost model (:mod:`kvpool.plan.cost`): the wait for the engine's
   prefill (each engine prefills one request at a time, first come first served), the lookup,
   the host-pool chunks at DRAM bandwidth, the storage chunks at SSD bandwidth (engine-cache
   hits cost nothing) and the prefill of the other tokens. The request stays in flight until
   TTFT + output tokens x ``decode_s_per_token``.

Load per engine is its mean requests in flight over the trace (Little's law: the sum of its
requests' times in flight over the span); ``load_max_vs_mean`` is the busiest engine's over the
mean. Deterministic: the random policy is seeded.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvpool.plan import cost
from kvpool.plan.dram import DramModel
from kvpool.plan.trace import Trace
from kvpool.policy import resolve_eviction_policy
from kvpool.route.policy import (
    DEFAULT_LOAD_TOKENS,
    DEFAULT_OVERLOAD,
    Candidate,
    RoutingPolicy,
    TierWeights,
    make_policy,
)

DEFAULT_ROUTING = ("kv", "round_robin", "random")
#: Per-engine tier sizes, as a share of the trace's distinct chunks (or bytes, see --dram).
DEFAULT_ENGINE_CACHE = "3%"
DEFAULT_HOST_POOL = "15%"
DEFAULT_STORAGE = "100%"


@dataclass(frozen=True)
class RoutingSettings:
    engines: int
    policies: Sequence[str] = DEFAULT_ROUTING
    engine_cache_chunks: int = 0  # per engine
    host_pool_chunks: int = 0  # per engine
    storage_chunks: int = 0  # shared
    host_policy: str = "auto"  # dram.eviction of the host pools
    weights: TierWeights = field(default_factory=TierWeights)
    load_tokens: float = DEFAULT_LOAD_TOKENS
    overload_factor: float = DEFAULT_OVERLOAD
    prefill_weight: float = 1.0
    seed: int = 0


@dataclass
class _Engine:
    cache: DramModel
    host: DramModel
    in_flight: list[float] = field(default_factory=list)  # heap of finish times
    prefilling: list[tuple[float, int]] = field(default_factory=list)  # (first token, tokens)
    pending_tokens: int = 0  # sum of the tokens in ``prefilling``
    free_at: float = 0.0  # when its prefill queue empties
    time_in_flight: float = 0.0
    requests: int = 0


def _split(keys: list[int], engine: _Engine, storage: DramModel) -> tuple[int, int, int]:
    """Chunks of the leading run served by the engine cache, the host pool, storage."""
    g = h = s = 0
    for k in keys:
        if k in engine.cache:
            g += 1
        elif k in engine.host:
            h += 1
        elif k in storage:
            s += 1
        else:
            break
    return g, h, s


def _apply(keys: list[int], engine: _Engine, storage: DramModel, served: int) -> None:
    """The engine runs the request: its caches and storage take what it read and computed."""
    for i, k in enumerate(keys):
        if k in engine.cache:
            engine.cache.read(k)
        else:
            engine.cache.put(k, False)
        if k in engine.host:
            engine.host.read(k)
        else:
            engine.host.put(k, True)
        if i >= served:
            storage.put(k, False)
        elif k in storage:
            storage.read(k)
    engine.host.note_put_batch(keys[served:])


def simulate(trace: Trace, policy: RoutingPolicy, settings: RoutingSettings,
             costs: cost.CostModel, chunk_bytes: int) -> dict[str, Any]:
    """Replay ``trace`` under one policy (see the module docstring). Raises ValueError for a
    trace without output lengths or a bad tier size."""
    if trace.output_tokens is None:
        raise ValueError("the routing simulation needs the trace's output lengths")
    started = time.perf_counter()
    host_policy = resolve_eviction_policy(settings.host_policy, True)
    engines = [_Engine(DramModel("lru", settings.engine_cache_chunks),
                       DramModel(host_policy, settings.host_pool_chunks))
               for _ in range(settings.engines)]
    storage = DramModel("lru", settings.storage_chunks)
    keys_all, tok_all = trace.keys.tolist(), trace.tokens.tolist()
    starts = trace.starts.tolist()
    order = np.argsort(trace.timestamps, kind="stable").tolist()
    n = trace.requests
    ttft = np.zeros(n)
    tier_tokens = np.zeros((n, 3), dtype=np.int64)
    reasons: dict[str, int] = {}
    chunk = trace.block_tokens
    for j in order:
        t = float(trace.timestamps[j])
        keys = keys_all[starts[j]:starts[j + 1]]
        for e in engines:
            while e.in_flight and e.in_flight[0] <= t:
                heapq.heappop(e.in_flight)
            while e.prefilling and e.prefilling[0][0] <= t:
                e.pending_tokens -= heapq.heappop(e.prefilling)[1]
        split: list[tuple[int, int, int]] = []
        cands = []
        for i, e in enumerate(engines):
            sp = _split(keys, e, storage) if policy.uses_prefix else (0, 0, 0)
            split.append(sp)
            g, h, s = sp
            cands.append(Candidate(i, g * chunk, h * chunk, s * chunk, len(e.in_flight),
                                   e.pending_tokens))
        d = policy.choose(cands)
        reasons[d.reason] = reasons.get(d.reason, 0) + 1
        e = engines[d.index]
        g, h, s = _split(keys, e, storage) if not policy.uses_prefix else split[d.index]
        served = g + h + s
        toks = tok_all[starts[j]:starts[j + 1]]
        tg, th = sum(toks[:g]), sum(toks[g:g + h])
        ts = sum(toks[g + h:served])
        tier_tokens[j] = (tg, th, ts)
        _apply(keys, e, storage, served)
        computed = int(trace.input_tokens[j]) - tg - th - ts
        prefill = computed * costs.prefill_s_per_token
        load = 0.0
        if h:
            load += costs.dram_latency_s + h * chunk_bytes / (costs.dram_read_gbps * 1e9)
        if s:
            load += costs.ssd_latency_s + s * chunk_bytes / (costs.ssd_read_gbps * 1e9)
        begin = max(t, e.free_at)
        e.free_at = begin + prefill
        ttft[j] = begin - t + costs.lookup_s + load + prefill
        done = ttft[j] + int(trace.output_tokens[j]) * costs.decode_s_per_token
        heapq.heappush(e.in_flight, t + done)
        # What the router counts as this engine's queue: the request's uncached tokens, until
        # its first token.
        heapq.heappush(e.prefilling, (t + ttft[j], computed))
        e.pending_tokens += computed
        e.time_in_flight += done
        e.requests += 1
    return _figures(trace, policy.name, engines, ttft, tier_tokens, reasons,
                    time.perf_counter() - started)


def _figures(trace: Trace, name: str, engines: list[_Engine], ttft: np.ndarray,
             tier_tokens: np.ndarray, reasons: dict[str, int],
             elapsed: float) -> dict[str, Any]:
    tokens = max(1, int(trace.input_tokens.sum()))
    ends = [max(e.in_flight, default=0.0) for e in engines]
    span = max(max(ends, default=0.0), trace.duration_s, 1e-9)
    load = [e.time_in_flight / span for e in engines]
    mean = sum(load) / len(load)
    per_tier = tier_tokens.sum(axis=0)
    return {
        "policy": name,
        "engine_cache_token_hit_rate": int(per_tier[0]) / tokens,
        "host_pool_token_hit_rate": int(per_tier[1]) / tokens,
        "storage_token_hit_rate": int(per_tier[2]) / tokens,
        "token_hit_rate": int(per_tier.sum()) / tokens,
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p90_s": float(np.percentile(ttft, 90)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "ttft_mean_s": float(ttft.mean()),
        "load_in_flight": load,
        "load_max_vs_mean": max(load) / mean if mean > 0 else 1.0,
        "requests_per_engine": [e.requests for e in engines],
        "decisions": reasons,
        "elapsed_s": elapsed,
    }


def run(trace: Trace, settings: RoutingSettings, costs: cost.CostModel,
        chunk_bytes: int) -> dict[str, Any]:
    """Every policy of ``settings`` on ``trace``, and the ratios the issue asks for (kv over
    round robin, when both ran). Raises ValueError for an unknown policy or fewer than one
    engine."""
    if settings.engines < 1:
        raise ValueError(f"--engines must be >= 1, got {settings.engines}")
    results = []
    for name in settings.policies:
        policy = make_policy(name, settings.weights, settings.load_tokens,
                             settings.overload_factor, settings.prefill_weight, settings.seed)
        results.append(simulate(trace, policy, settings, costs, chunk_bytes))
    by = {r["policy"]: r for r in results}
    out: dict[str, Any] = {
        "trace": trace.name,
        "requests": trace.requests,
        "settings": {**asdict(settings), "weights": asdict(settings.weights)},
        "cost_model": asdict(costs),
        "chunk_bytes": chunk_bytes,
        "policies": results,
        # Prefill demand with no cache over what the engines can prefill in the trace's span:
        # above 1 the queues grow without bound and TTFT is mostly waiting.
        "offered_prefill_load": float(trace.input_tokens.sum()) * costs.prefill_s_per_token
        / max(trace.duration_s, 1e-9) / settings.engines,
    }
    if "kv" in by:
        out["routing_kv_load_max_vs_mean"] = by["kv"]["load_max_vs_mean"]
        for other in ("round_robin", "random"):
            if other in by and by[other]["ttft_p50_s"] > 0:
                out[f"routing_kv_vs_{other}_ttft_p50"] = (by["kv"]["ttft_p50_s"]
                                                         / by[other]["ttft_p50_s"])
                out[f"routing_kv_vs_{other}_ttft_p90"] = (by["kv"]["ttft_p90_s"]
                                                         / by[other]["ttft_p90_s"])
    return out
