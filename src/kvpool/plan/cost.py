"""TTFT and cost model: what a replay's hits are worth in seconds and money.

Per request, TTFT = lookup + load of the hit prefix from the tiers that served it (latency +
bytes / read bandwidth, per tier) + prefill of the other prompt tokens at a fixed cost per
token. Prefill cost is taken as linear in tokens (attention's quadratic term is left out) and
the decode of output tokens, which the cache does not change, is left out.

Cost per million prompt tokens: the engine is paid for the seconds it spends on TTFT (busy
time, requests back to back) at ``gpu_hour_usd``, and its cache tiers for the same seconds at
their GiB-month prices (a month = 730 hours). "No cache" is the same engine prefilling every
token with no tiers.

Defaults (``CostModel``): prefill is measured here, on the demo model: ``make demo`` on the
2-core VM, SmolLM2-135M on the CPU, 12.98 s to prefill 5,984 tokens (README.md) = 2.17 ms per
token. DRAM 10 GB/s and SSD 1.2 GB/s read are measured here too (a numpy copy into a
preallocated buffer: 10-12 GB/s; O_DIRECT ``preadv``: 1.0-1.4 GB/s); the latencies and every
price are assumed (list prices of late 2026: a GPU-hour of an H100-class card $2.50, DRAM $3 and
NVMe $0.08 per GiB-month). Prefill speed and GPU price must describe the same engine: for a GPU
deployment pass both (``--prefill-s-per-token``, ``--gpu-hour-usd``).
"""

from __future__ import annotations

import json
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
    prefill_s_per_token: float = 12.98 / 5984  # measured: make demo, SmolLM2-135M, CPU
    lookup_s: float = 200e-6  # assumed: one lookup across the local tiers
    dram_read_gbps: float = 10.0  # measured here (numpy copy into a preallocated buffer)
    dram_latency_s: float = 10e-6  # assumed
    ssd_read_gbps: float = 1.2  # measured here (O_DIRECT preadv)
    ssd_latency_s: float = 100e-6  # measured here: 4 KiB random read at queue depth 1, ~70 µs
    gpu_hour_usd: float = 2.50  # assumed
    dram_gib_month_usd: float = 3.00  # assumed
    ssd_gib_month_usd: float = 0.08  # assumed

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


def summarize(trace: Trace, model: CostModel, seconds: np.ndarray, dram_bytes: int,
              ssd_bytes: int) -> dict[str, Any]:
    """TTFT p50 / p99 / mean, prefill tokens/s and cost per million prompt tokens."""
    busy = float(seconds.sum())
    tokens = float(trace.input_tokens.sum())
    storage_per_s = (dram_bytes / GIB * model.dram_gib_month_usd
                     + ssd_bytes / GIB * model.ssd_gib_month_usd) / MONTH_S
    usd = busy * (model.gpu_hour_usd / 3600.0 + storage_per_s)
    return {
        "ttft_p50_s": float(np.percentile(seconds, 50)),
        "ttft_p99_s": float(np.percentile(seconds, 99)),
        "ttft_mean_s": busy / max(1, seconds.size),
        "tokens_per_s": tokens / busy if busy > 0 else float("inf"),
        "busy_s": busy,
        "usd_per_mtok": usd / (tokens / 1e6) if tokens else 0.0,
    }
