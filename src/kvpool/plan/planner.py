"""The grid: every DRAM size x SSD size x policy replayed, Belady at each DRAM size, the TTFT
and cost of each, the ratios and the cheapest configuration that meets a TTFT target.

Sizes (``--dram``, ``--ssd``) are bytes (``4GiB``, ``500MB``, ``0`` for no tier) or a
percentage of the trace's distinct chunks (``25%``). DRAM holds ``bytes // slot`` chunks (a
slot is a chunk rounded up to 4 KiB); the SSD holds whole segments (bytes rounded down, at
least 2; a percentage is rounded up to whole segments of the records that fit one).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvpool.config import MAX_SEGMENTS, DramConfig, PoolConfig, SsdConfig, parse_size
from kvpool.plan import cost
from kvpool.plan.belady import BeladyResult, belady, next_use
from kvpool.plan.replay import ReplayResult, SsdWrite, TierConfig, replay
from kvpool.plan.ssd import records_per_segment
from kvpool.plan.trace import Trace
from kvpool.policy import resolve_eviction_policy
from kvpool.record import round_up

#: The DRAM capacities (fractions of the distinct chunks) the JSON's ratios are taken at.
RATIO_POINTS = {"hit_rate_vs_belady_10pct": 0.10, "hit_rate_vs_belady_25pct": 0.25}
#: The same points against LRU (the default policy's chunk hit rate over LRU's, DRAM only).
LRU_RATIO_POINTS = {"hit_rate_vs_lru_10pct": 0.10, "hit_rate_vs_lru_25pct": 0.25}


def config_default(section: type[DramConfig | SsdConfig | PoolConfig], name: str) -> Any:
    """A setting's default, as docs/config.md lists it: the planner follows the pool's."""
    return section.model_fields[name].default


_SSD_POLICY: str = config_default(SsdConfig, "eviction")
_SEGMENT_SIZE: int = config_default(SsdConfig, "segment_size")
_COPY_FORWARD: float = config_default(SsdConfig, "copy_forward_fraction")
_SSD_WRITE: SsdWrite = config_default(PoolConfig, "ssd_write")
_ADMISSION: str = config_default(SsdConfig, "admission")


@dataclass(frozen=True)
class Size:
    label: str
    chunks: int
    nbytes: int


@dataclass(frozen=True)
class PlanSettings:
    bytes_per_token: int
    model: str | None
    dram: Sequence[str]
    ssd: Sequence[str]
    policies: Sequence[str]
    ssd_policy: str = _SSD_POLICY
    segment_size: int = _SEGMENT_SIZE
    copy_forward_fraction: float = _COPY_FORWARD
    ssd_write: SsdWrite = _SSD_WRITE
    admission: str = _ADMISSION
    ttft_p99_s: float | None = None
    costs: cost.CostModel = field(default_factory=cost.CostModel)
    preset: str = cost.DEFAULT_PRESET
    cost_sources: dict[str, str] = field(default_factory=lambda: dict(cost.SOURCES))

    def chunk_bytes(self, trace: Trace) -> int:
        return trace.block_tokens * self.bytes_per_token


def _fraction(spec: str) -> float | None:
    """0.25 for ``"25%"``; None for a byte size. Raises ValueError for a bad percentage."""
    if not spec.endswith("%"):
        return None
    try:
        pct = float(spec[:-1])
    except ValueError:
        raise ValueError(f"not a percentage: {spec!r}") from None
    if not math.isfinite(pct) or pct < 0:
        raise ValueError(f"a percentage must be a finite number >= 0, got {spec!r}")
    return pct / 100.0


def dram_size(spec: str, trace: Trace, chunk_bytes: int) -> Size:
    """Raises ValueError for a size that is neither bytes nor a percentage."""
    slot = round_up(chunk_bytes)
    frac = _fraction(spec)
    if frac is not None:
        chunks = int(frac * trace.distinct)
        return Size(spec, chunks, chunks * slot)
    nbytes = parse_size(spec)
    return Size(spec, nbytes // slot, nbytes)


def ssd_size(spec: str, trace: Trace, chunk_bytes: int, segment_size: int) -> Size:
    """Chunks the SSD holds (0: no SSD). Raises ValueError for a bad size, one of fewer than
    two segments or more than the engine's MAX_SEGMENTS, or a chunk that does not fit a
    segment."""
    frac = _fraction(spec)
    nbytes = 0 if frac is not None else parse_size(spec)
    if frac == 0 or (frac is None and nbytes == 0):
        return Size(spec, 0, 0)
    per = records_per_segment(segment_size, chunk_bytes)
    if per < 1:
        raise ValueError(f"a chunk of {chunk_bytes} bytes does not fit an SSD segment of "
                         f"{segment_size} bytes; raise --ssd-segment")
    if frac is not None:
        segments = max(2, -(-int(frac * trace.distinct) // per))
    else:
        segments = nbytes // segment_size
        if segments < 2:
            raise ValueError(f"--ssd {spec}: less than two segments of {segment_size} bytes "
                             "(the engine's minimum); raise it or lower --ssd-segment")
    if segments > MAX_SEGMENTS:
        raise ValueError(f"--ssd {spec}: {segments:,} segments of {segment_size} bytes, more "
                         f"than the engine's {MAX_SEGMENTS:,}; lower it or raise --ssd-segment")
    return Size(spec, segments * per, segments * segment_size)


def hit_figures(trace: Trace, hits: np.ndarray, hit_tokens: np.ndarray) -> dict[str, float]:
    """Request, chunk and token hit rates and the prefill tokens saved. The request hit
    fraction is the mean over requests with a cacheable chunk of the share of its chunks
    served (each request weighs the same; the chunk hit rate weighs long prompts more)."""
    saved = int(hit_tokens.sum())
    per = np.diff(trace.starts)
    some = per > 0
    return {
        "request_hit_fraction": float(np.mean(hits[some] / per[some])) if some.any() else 0.0,
        "chunk_hit_rate": float(hits.sum()) / max(1, trace.references),
        "token_hit_rate": saved / max(1, int(trace.input_tokens.sum())),
        "prefill_tokens_saved": saved,
    }


def _row(trace: Trace, s: PlanSettings, dram: Size, ssd: Size, res: ReplayResult,
         bel: BeladyResult, span: float) -> dict[str, Any]:
    """One configuration's figures. ``bel`` is Belady at the same total capacity: DRAM's with
    no SSD, DRAM + SSD chunks with one (a bound on hits from either tier)."""
    cb = s.chunk_bytes(trace)
    c = res.counters
    row: dict[str, Any] = {"policy": res.config.policy, "dram": dram.label,
                           "dram_chunks": dram.chunks, "dram_bytes": dram.nbytes,
                           "ssd": ssd.label, "ssd_chunks": ssd.chunks, "ssd_bytes": ssd.nbytes}
    row.update(hit_figures(trace, res.hits, res.hit_tokens))
    row["dram_chunk_hit_rate"] = float(res.dram_hits.sum()) / max(1, trace.references)
    row["ssd_chunk_hit_rate"] = float(res.ssd_hits.sum()) / max(1, trace.references)
    bel_rate = float(bel.hits.sum()) / max(1, trace.references)
    row["belady_chunk_hit_rate"] = bel_rate
    row["belady_capacity_chunks"] = bel.capacity
    row["belady_basis"] = "dram+ssd" if ssd.chunks else "dram"
    row["vs_belady"] = row["chunk_hit_rate"] / bel_rate if bel_rate else None
    writes, forwarded = c.get("ssd_writes", 0), c.get("ssd_forwarded", 0)
    row.update(dram_read_bytes=c["dram_reads"] * cb, dram_written_bytes=c["dram_writes"] * cb,
               dram_evictions=c["dram_evictions"],
               ssd_read_bytes=c.get("ssd_reads", 0) * cb, ssd_written_bytes=writes * cb,
               ssd_copy_forward_bytes=forwarded * cb,
               ssd_write_amplification=forwarded / writes if writes else 0.0,
               ssd_dropped_chunks=c.get("ssd_dropped", 0))
    # Wear per use: records written (puts, demotions, copy-forward) per chunk later served.
    reads = c.get("ssd_reads", 0)
    row["ssd_written_per_hit_byte"] = (writes + forwarded) / reads if reads else None
    seconds = cost.ttft(trace, s.costs, cb, res.dram_hits, res.ssd_hits, res.hit_tokens)
    row.update(cost.summarize(trace, s.costs, seconds, res.hit_tokens, dram.nbytes,
                              ssd.nbytes, span))
    row["elapsed_s"] = res.elapsed_s
    return row


def default_vs_lru(trace: Trace, policy: str, chunk_bytes: int) -> dict[str, dict[str, Any]]:
    """``policy``'s chunk hit rate over LRU's, DRAM only, at each of ``LRU_RATIO_POINTS``
    (nan where LRU hits nothing)."""
    out: dict[str, dict[str, Any]] = {}
    for name, frac in LRU_RATIO_POINTS.items():
        chunks = int(frac * trace.distinct)
        got, lru = (float(replay(trace, TierConfig(p, chunks), chunk_bytes).hits.sum())
                    / max(1, trace.references) for p in (policy, "lru"))
        out[name] = {"ratio": got / lru if lru else float("nan"), "policy": policy,
                     "dram_chunks": chunks, "chunk_hit_rate": got, "lru_chunk_hit_rate": lru}
    return out


def _config(s: PlanSettings, policy: str, dram: Size, ssd: Size) -> TierConfig:
    segments = ssd.nbytes // s.segment_size if ssd.chunks else 0
    return TierConfig(policy, dram.chunks, segments, s.ssd_policy, s.segment_size,
                      s.copy_forward_fraction, s.ssd_write, s.admission)


def plan(trace: Trace, s: PlanSettings) -> dict[str, Any]:
    """Replay the whole grid; returns the JSON-ready result (see docs/plan.md). Raises
    ValueError for a bad size or an unknown policy name."""
    started = time.perf_counter()
    cb = s.chunk_bytes(trace)
    drams = [dram_size(d, trace, cb) for d in s.dram]
    ssds = [ssd_size(x, trace, cb, s.segment_size) for x in s.ssd]
    nxt = next_use(trace.keys)
    span, span_source = cost.span_s(trace, s.costs)
    bel_cache: dict[int, BeladyResult] = {}

    def bel(chunks: int) -> BeladyResult:
        if chunks not in bel_cache:
            bel_cache[chunks] = belady(trace, chunks, nxt)
        return bel_cache[chunks]

    rows = [_row(trace, s, d, x, replay(trace, _config(s, p, d, x), cb),
                 bel(d.chunks + x.chunks), span)
            for d in drams for x in ssds for p in s.policies]
    belady_rows = []
    for d in drams:
        b = bel(d.chunks)
        seconds = cost.ttft(trace, s.costs, cb, b.hits, np.zeros_like(b.hits), b.hit_tokens)
        belady_rows.append({"dram": d.label, "dram_chunks": d.chunks, "dram_bytes": d.nbytes,
                            **hit_figures(trace, b.hits, b.hit_tokens),
                            "resident_hit_rate": b.resident_hits / max(1, trace.references),
                            **cost.summarize(trace, s.costs, seconds, b.hit_tokens,
                                             d.nbytes, 0, span),
                            "elapsed_s": b.elapsed_s})
    # DRAM-only ratios: dram.eviction auto is the policy it stands for with nothing below.
    default_policy = resolve_eviction_policy(config_default(DramConfig, "eviction"), False)
    ratios: dict[str, float] = {}
    basis: dict[str, Any] = {}
    for name, frac in RATIO_POINTS.items():
        d = Size(f"{frac:.0%}", int(frac * trace.distinct), 0)
        res = replay(trace, TierConfig(default_policy, d.chunks), cb)
        got = float(res.hits.sum()) / max(1, trace.references)
        best = float(bel(d.chunks).hits.sum()) / max(1, trace.references)
        ratios[name] = got / best if best else float("nan")
        basis[name] = {"policy": default_policy, "dram_chunks": d.chunks,
                       "chunk_hit_rate": got, "belady_chunk_hit_rate": best}
    lru_ratios = default_vs_lru(trace, default_policy, cb)
    json_ratios = {**ratios, **{k: v["ratio"] for k, v in lru_ratios.items()}}
    base = cost.summarize(trace, s.costs, cost.no_cache_ttft(trace, s.costs), 0, 0, 0, span)
    cheapest = None
    if s.ttft_p99_s is not None:
        ok = [r for r in [{"policy": "none", "dram": "0", "ssd": "0", **base}, *rows]
              if r["ttft_p99_s"] <= s.ttft_p99_s]
        cheapest = min(ok, key=lambda r: r["usd_per_mtok"]) if ok else None
    return {
        "suite": "plan",
        "trace": {"name": trace.name, "requests": trace.requests,
                  "references": trace.references, "distinct_chunks": trace.distinct,
                  "block_tokens": trace.block_tokens, "duration_s": trace.duration_s,
                  "partial_chunks_not_stored": trace.partial_chunks,
                  "prompt_tokens": int(trace.input_tokens.sum())},
        "model": s.model, "bytes_per_token": s.bytes_per_token, "chunk_bytes": cb,
        "settings": {"ssd_policy": s.ssd_policy, "segment_size": s.segment_size,
                     "copy_forward_fraction": s.copy_forward_fraction,
                     "ssd_write": s.ssd_write, "admission": s.admission,
                     "default_policy": default_policy},
        "cost_model": asdict(s.costs),
        "cost_preset": s.preset,
        "cost_sources": s.cost_sources,
        "cost_span_s": span,
        "cost_span_source": span_source,
        "ratios": ratios,
        "ratio_basis": basis,
        **json_ratios,
        "lru_ratio_basis": lru_ratios,
        "ratio_meaning": "the default DRAM policy's chunk hit rate over Belady's, DRAM only, "
                         "at a capacity of that fraction of the trace's distinct chunks",
        "no_cache": base,
        "belady": belady_rows,
        "rows": rows,
        "ttft_p99_target_s": s.ttft_p99_s,
        "cheapest": cheapest,
        "elapsed_s": time.perf_counter() - started,
    }
