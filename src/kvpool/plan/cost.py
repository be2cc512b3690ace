"""TTFT and cost model: what a replay's hits are worth in seconds and money.

Per request, TTFT = lookup + load of the hit prefix from the tiers that served it (latency +
bytes / read bandwidth, per tier) + prefill of the other prompt tokens at a fixed cost per
token. Prefill cost is taken as linear in tokens (attention's quadratic term is left out) and
the decode of output tokens, which the cache does not change, is left out.

Cost per million prompt tokens, over the trace's own span (first to last arrival, measured
from the trace): the prefill demand is the tokens the engines must compute (prompt tokens the
cache did not serve) x ``prefill_s_per_token`` (the stated engine throughput), in
engine-seconds; the engines needed to serve it in the span are demand / span (``engines``,
and ``engines_whole`` rounded up), and are paid for that demand at ``engine_hour_usd`` (a
fleet sized to the load). Loads from the tiers add to TTFT but not to engine time (the KV
transfer overlaps other requests' compute). The tiers are one shared pool, paid for the whole
span at their GiB-month prices (a month = 730 hours). "No cache" is the same engines
prefilling every token, with no tiers.

Presets (``PRESETS``, ``--preset``) describe an engine: its model (KV bytes per token), prefill
speed, price and the read bandwidths its tiers reach. ``cpu`` is this machine, measured;
``gpu-70b`` is a 70B-class model on an 8-GPU node, assumed. ``SOURCES`` says for every figure
whether it is measured or assumed; the report prints it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.plan.trace import Trace

GIB = 1 << 30
MONTH_S = 730 * 3600.0

#: Bytes of KV cache per token, by ``--model`` name: (bytes, where the figure comes from).
MODELS: dict[str, tuple[int, str]] = {
    "smollm2-135m": (46_080, "SmolLM2-135M as kvpool's HF integration stores it: 30 layers x "
                             "3 KV heads x 64 x (K, V) x fp32 (kvpool.integrations.models)"),
    "llama-3-8b": (131_072, "Llama-3-8B: 32 layers x 8 KV heads x 128 x (K, V) x bf16"),
    "llama-3-70b": (327_680, "a 70B-class model, Llama-3-70B: 80 layers x 8 KV heads x 128 x "
                             "(K, V) x bf16"),
}
DEFAULT_MODEL = "smollm2-135m"


def model_bytes_per_token(name: str) -> int:
    """Raises ValueError for a model not in ``MODELS`` (pass --bytes-per-token instead)."""
    try:
        return MODELS[name][0]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)} "
                         "(or give --bytes-per-token)") from None


@dataclass(frozen=True)
class CostModel:
    """The figures the cost model uses; defaults are the ``cpu`` preset (see ``SOURCES``)."""

    prefill_s_per_token: float = 12.98 / 5984
    lookup_s: float = 200e-6
    dram_read_gbps: float = 10.0
    dram_latency_s: float = 10e-6
    ssd_read_gbps: float = 1.2
    ssd_latency_s: float = 100e-6
    engine_hour_usd: float = 0.10
    dram_gib_month_usd: float = 3.00
    ssd_gib_month_usd: float = 0.08
    # Only the routing simulation uses it: how long a request stays in flight after its
    # first token (``kvpool plan --engines``); the single-engine plan leaves decode out.
    decode_s_per_token: float = 0.02

    def with_storage_json(self, path: Path | str) -> CostModel:
        """Read bandwidths from ``kvpool bench storage --json`` output: DRAM from the
        ``dram/get_into`` case, SSD from the best cold ``ssd`` read case (kvpool's GB/s, the
        largest chunk size measured). Raises ValueError if the file holds neither case,
        OSError if it cannot be read."""
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        cases = data.get("cases", []) if isinstance(data, dict) else []

        def best(group: str, match: str) -> float | None:
            rows = [c for c in cases if c.get("group") == group and match in c.get("case", "")]
            if not rows:
                return None
            top = max(rows, key=lambda c: c.get("chunk_bytes", 0))
            return float(top["kvpool"]["gb_per_s"])

        dram, ssd = best("dram", "get_into"), best("ssd", "cold")
        if dram is None and ssd is None:
            raise ValueError(f"{path}: no dram get_into or ssd cold read case (is it the "
                             "output of kvpool bench storage --json?)")
        return replace(self, dram_read_gbps=dram or self.dram_read_gbps,
                       ssd_read_gbps=ssd or self.ssd_read_gbps)


#: Where each figure of the ``cpu`` preset (the CostModel defaults) comes from.
SOURCES: dict[str, str] = {
    "prefill_s_per_token": "measured here: make demo, SmolLM2-135M on this 2-core CPU VM, "
                           "12.98 s to prefill 5,984 tokens",
    "lookup_s": "assumed: one lookup across the local tiers",
    "dram_read_gbps": "measured here: numpy copy into a preallocated buffer, 10-12 GB/s",
    "dram_latency_s": "assumed",
    "ssd_read_gbps": "measured here: O_DIRECT preadv, 1.0-1.4 GB/s",
    "ssd_latency_s": "measured here: 4 KiB random read at queue depth 1, ~70 us",
    "engine_hour_usd": "assumed: a 2-vCPU, 8 GiB cloud VM on demand (late 2026 list price)",
    "dram_gib_month_usd": "assumed: cloud DRAM, late 2026",
    "ssd_gib_month_usd": "assumed: cloud NVMe, late 2026",
    "decode_s_per_token": "assumed: 50 tokens/s per request while the engine batches others",
}


@dataclass(frozen=True)
class Preset:
    """An engine: its model, the cost figures that differ from the defaults, and their
    sources."""

    model: str
    figures: dict[str, float]
    sources: dict[str, str]
    description: str
    segment_size: int | None = None  # ssd.segment_size for this KV size; None: the default


PRESETS: dict[str, Preset] = {
    "cpu": Preset("smollm2-135m", {}, {},
                  "SmolLM2-135M (fp32 KV) on this 2-core CPU VM, as make demo runs it"),
    "gpu-70b": Preset(
        "llama-3-70b",
        {"prefill_s_per_token": 1 / 20_000, "engine_hour_usd": 20.0,
         "dram_read_gbps": 100.0, "ssd_read_gbps": 12.0, "decode_s_per_token": 0.025},
        {"prefill_s_per_token": "assumed: 20,000 prompt tokens/s for Llama-3-70B on 8 "
                                "H100s, tensor-parallel (2 x 70e9 FLOP/token at ~35% of "
                                "8 x 989 TFLOP/s bf16)",
         "engine_hour_usd": "assumed: 8 H100-class GPU-hours at $2.50",
         "dram_read_gbps": "assumed: host DRAM to the 8 GPUs, each loading its shard over "
                           "its own PCIe 5.0 x16 link (~12.5 GB/s each)",
         "ssd_read_gbps": "assumed: 4 NVMe Gen4 drives striped, ~3 GB/s each",
         "decode_s_per_token": "assumed: 40 tokens/s per request at a decode batch of "
                               "tens of requests"},
        "Llama-3-70B (bf16 KV) on an 8 x H100 node, one engine per node",
        segment_size=2 << 30),  # a 512-token chunk is 160 MiB: 256 MiB segments hold one
}
DEFAULT_PRESET = "cpu"


def span_s(trace: Trace, model: CostModel) -> tuple[float, str]:
    """The seconds the cost is taken over, and how they were found: the trace's arrival span
    when it has one, else (all requests at one instant) the time one engine takes to prefill
    it all, requests back to back."""
    if trace.duration_s > 0:
        return trace.duration_s, "the trace's first to last arrival"
    busy = float(trace.input_tokens.sum()) * model.prefill_s_per_token
    return max(busy, 1e-9), "no arrival span in the trace: one engine prefilling it all"


def ttft(trace: Trace, model: CostModel, chunk_bytes: int, dram_hits: np.ndarray,
         ssd_hits: np.ndarray, hit_tokens: np.ndarray) -> np.ndarray:
    """Seconds to first token per request, from the chunks each tier served."""
    def load(chunks: np.ndarray, gbps: float, latency: float) -> np.ndarray:
        return np.where(chunks > 0, latency + chunks * chunk_bytes / (gbps * 1e9), 0.0)

    prefill = (trace.input_tokens - hit_tokens) * model.prefill_s_per_token
    return np.asarray(model.lookup_s + load(dram_hits, model.dram_read_gbps, model.dram_latency_s)
            + load(ssd_hits, model.ssd_read_gbps, model.ssd_latency_s) + prefill,
                      dtype=np.float64)


def no_cache_ttft(trace: Trace, model: CostModel) -> np.ndarray:
    return np.asarray(trace.input_tokens * model.prefill_s_per_token, dtype=np.float64)


def summarize(trace: Trace, model: CostModel, seconds: np.ndarray, hit_tokens: np.ndarray | int,
              dram_bytes: int, ssd_bytes: int, span: float) -> dict[str, Any]:
    """TTFT p50 / p99 / mean, the engines the prefill demand needs over ``span`` seconds and
    the cost per million prompt tokens (see the module docstring)."""
    tokens = float(trace.input_tokens.sum())
    computed = tokens - float(np.sum(hit_tokens))
    demand = computed * model.prefill_s_per_token  # engine-seconds of prefill
    engine_usd = demand * model.engine_hour_usd / 3600.0
    storage_usd = (dram_bytes / GIB * model.dram_gib_month_usd
                   + ssd_bytes / GIB * model.ssd_gib_month_usd) / MONTH_S * span
    mtok = tokens / 1e6
    engines = demand / span if span > 0 else 0.0
    return {
        "ttft_p50_s": float(np.percentile(seconds, 50)) if seconds.size else 0.0,
        "ttft_p99_s": float(np.percentile(seconds, 99)) if seconds.size else 0.0,
        "ttft_mean_s": float(seconds.sum()) / max(1, seconds.size),
        "prefill_engine_s": demand,
        "engines": engines,
        "engines_whole": math.ceil(engines - 1e-9),
        "tokens_per_engine_s": tokens / demand if demand > 0 else float("inf"),
        "engine_usd_per_mtok": engine_usd / mtok if mtok else 0.0,
        "storage_usd_per_mtok": storage_usd / mtok if mtok else 0.0,
        "usd_per_mtok": (engine_usd + storage_usd) / mtok if mtok else 0.0,
    }
