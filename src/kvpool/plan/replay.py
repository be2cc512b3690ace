"""Replay a trace through the tier models: per request, the calls ``KVPool`` makes.

``replay_request`` is the one place that decides which tier calls a request makes, in which
order (see its docstring); ``DramModel`` and ``SsdModel`` turn them into calls on kvpool's own
policy objects. Deterministic: the same trace and configuration give the same figures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from kvpool.plan.dram import DramModel
from kvpool.plan.ssd import SsdModel
from kvpool.plan.trace import Trace
from kvpool.policy import AdmissionPolicy, make_admission_policy, resolve_eviction_policy

SsdWrite = Literal["through", "evict"]


@dataclass(frozen=True)
class TierConfig:
    """One configuration to replay: the settings of the same names in docs/config.md."""

    policy: str  # dram.eviction
    dram_chunks: int
    ssd_segments: int = 0  # 0: no SSD tier
    ssd_policy: str = "second_chance"  # ssd.eviction
    segment_size: int = 256 << 20  # ssd.segment_size
    copy_forward_fraction: float = 0.25  # ssd.copy_forward_fraction
    ssd_write: SsdWrite = "through"  # pool.ssd_write
    admission: str = "always"  # ssd.admission (used with ssd_write: evict)
    second_use_window: int = 65536  # ssd.second_use_window
    promote_on_hit: bool = True  # pool.promote_on_hit


@dataclass
class ReplayResult:
    """Per request: the prefix chunks (and their tokens) each tier served."""

    config: TierConfig
    dram_hits: np.ndarray
    ssd_hits: np.ndarray
    dram_hit_tokens: np.ndarray
    ssd_hit_tokens: np.ndarray
    counters: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def hits(self) -> np.ndarray:
        return np.asarray(self.dram_hits + self.ssd_hits)

    @property
    def hit_tokens(self) -> np.ndarray:
        return np.asarray(self.dram_hit_tokens + self.ssd_hit_tokens)


class _Demoter:
    """``kvpool.tiers.stack.Demoter``: a victim no lower tier holds goes to the SSD if the
    admission policy admits it."""

    def __init__(self, admission: AdmissionPolicy, ssd: SsdModel | None) -> None:
        self._admission, self._ssd = admission, ssd
        self.demoted = 0

    def __call__(self, key: int, hits: int, on_lower: bool) -> None:
        if on_lower or self._ssd is None or not self._admission.admit(key, hits):
            return
        self.demoted += 1
        self._ssd.write(key)


def replay_request(dram: DramModel, ssd: SsdModel | None, keys: list[int],
                   through: bool, promote: bool) -> tuple[int, list[int]]:
    """One request, as an engine drives KVPool: returns (prefix length, positions in the
    prefix that the SSD served). The calls, in order:

    1. ``KVPool.lookup(keys)``: the leading run of keys DRAM or the SSD holds (membership
       only: ``contains_many`` touches no policy).
    2. ``KVPool.get_many_into(keys[:n])``: each chunk DRAM holds is read (``policy.touch``);
       the others are read from the SSD (marked hot for copy-forward).
    3. Promotion (``pool.promote_on_hit``, the mover): each SSD-served chunk is put into DRAM
       as held below (``on_lower=True``): ``touch`` if resident, else evict-when-full, insert.
    4. ``KVPool.put_many(keys[n:])``: with ``pool.ssd_write: through`` every chunk is written
       to the SSD first (the engine appends a new record even for a chunk it holds), then put
       into DRAM with ``on_lower=True``; with ``evict`` it is put into DRAM only, and DRAM
       victims not held below go to the SSD as the admission policy says; then the batch
       goes to ``policy.put_batch`` (a prefix-aware policy orders it tail-first).
    """
    n = 0
    for k in keys:
        if k in dram or (ssd is not None and k in ssd):
            n += 1
        else:
            break
    below: list[int] = []
    for i in range(n):
        k = keys[i]
        if k in dram:
            dram.read(k)
        else:
            assert ssd is not None
            ssd.read(k)
            below.append(i)
    if promote:
        for i in below:
            dram.put(keys[i], True)
    rest = keys[n:]
    if through and ssd is not None:
        for k in rest:
            ssd.write(k)
        for k in rest:
            dram.put(k, True)
    else:
        for k in rest:
            dram.put(k, False)
    dram.note_put_batch(rest)
    return n, below


def replay(trace: Trace, cfg: TierConfig, chunk_bytes: int) -> ReplayResult:
    """Replay every request of ``trace`` under ``cfg``. Raises ValueError for an unknown
    policy name or an impossible geometry (see DramModel, SsdModel)."""
    started = time.perf_counter()
    ssd = SsdModel(cfg.ssd_policy, cfg.ssd_segments, cfg.segment_size, chunk_bytes,
                   cfg.copy_forward_fraction) if cfg.ssd_segments else None
    demoter = _Demoter(make_admission_policy(cfg.admission, cfg.second_use_window), ssd)
    # dram.eviction: auto resolves as tiers/stack.py resolves it: by whether an SSD is below.
    dram = DramModel(resolve_eviction_policy(cfg.policy, ssd is not None), cfg.dram_chunks,
                     demoter)
    # As tiers/stack.py builds it: with no DRAM every put goes to the SSD, whatever ssd_write.
    through = cfg.ssd_write == "through" or cfg.dram_chunks == 0
    promote = cfg.promote_on_hit and cfg.dram_chunks > 0
    keys, tokens = trace.keys.tolist(), trace.tokens.tolist()
    starts = trace.starts.tolist()
    r = trace.requests
    dram_hits = np.zeros(r, dtype=np.int64)
    ssd_hits = np.zeros(r, dtype=np.int64)
    dram_tok = np.zeros(r, dtype=np.int64)
    ssd_tok = np.zeros(r, dtype=np.int64)
    for j in range(r):
        s, e = starts[j], starts[j + 1]
        n, below = replay_request(dram, ssd, keys[s:e], through, promote)
        if n:
            hit_tok = sum(tokens[s:s + n])
            below_tok = sum(tokens[s + i] for i in below)
            dram_hits[j], ssd_hits[j] = n - len(below), len(below)
            dram_tok[j], ssd_tok[j] = hit_tok - below_tok, below_tok
    counters: dict[str, Any] = {
        "dram_reads": dram.reads, "dram_writes": dram.writes, "dram_evictions": dram.evictions,
        "demotions": demoter.demoted,
    }
    if ssd is not None:
        counters.update(ssd_reads=ssd.reads, ssd_writes=ssd.writes,
                        ssd_forwarded=ssd.forwarded, ssd_dropped=ssd.dropped,
                        ssd_segments_evicted=ssd.segments_evicted,
                        ssd_capacity_chunks=ssd.capacity_chunks)
    return ReplayResult(cfg, dram_hits, ssd_hits, dram_tok, ssd_tok, counters,
                        time.perf_counter() - started)
