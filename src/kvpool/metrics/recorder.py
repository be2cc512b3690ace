"""Latency histograms of a KVPool's calls: per op end to end (``kvpool_op_seconds``) and per
tier and op (``kvpool_tier_op_seconds``), recorded under one lock per call."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvpool.metrics.catalogue import POOL_OPS
from kvpool.metrics.histogram import LatencyHistogram

#: (tier index in read order, seconds) for each tier a call asked.
TierTimings = list[tuple[int, float]]
#: Per label values: (bucket counts, sum).
Series = dict[tuple[str, ...], tuple[list[int], float]]


class OpLatency:
    """``labels``: the tiers' metric labels in read order. Every method is thread-safe and
    never raises."""

    def __init__(self, labels: Sequence[str]) -> None:
        self._labels = list(labels)
        self._lock = threading.Lock()
        self._ops = {op: LatencyHistogram() for op in POOL_OPS}
        self._tiers: dict[tuple[str, ...], LatencyHistogram] = {
            (tier, op): LatencyHistogram() for tier in self._labels for op in POOL_OPS}

    def record(self, op: str, seconds: float, timings: TierTimings) -> None:
        """One call of ``op`` took ``seconds``; ``timings`` says how long each tier it asked
        took."""
        with self._lock:
            self._ops[op].observe(seconds)
            for index, tier_seconds in timings:
                self._tiers[(self._labels[index], op)].observe(tier_seconds)

    def snapshot(self) -> tuple[Series, Series]:
        """(per op, per (tier, op)) bucket counts and sums; series never observed are left
        out of the tier map, so a scrape shows the tiers a pool has used."""
        with self._lock:
            ops: Series = {(op, ): h.snapshot() for op, h in self._ops.items()}
            tiers = {key: h.snapshot() for key, h in self._tiers.items() if any(h.counts)}
        return ops, tiers


class LabeledLatency:
    """Latency per value of one label (a node's protocol ops, an engine's TTFT), series
    created on first use. Thread-safe; never raises."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ops: dict[str, LatencyHistogram] = {}

    def record(self, label: str, seconds: float) -> None:
        with self._lock:
            hist = self._ops.get(label)
            if hist is None:
                hist = self._ops[label] = LatencyHistogram()
            hist.observe(seconds)

    def snapshot(self) -> Series:
        with self._lock:
            return {(op,): h.snapshot() for op, h in self._ops.items()}
