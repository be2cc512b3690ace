"""Latency histograms of a KVPool's calls: per op end to end (``kvpool_op_seconds``) and per
tier and op (``kvpool_tier_op_seconds``).

Every pool call records here, so recording takes no lock: each thread fills its own shard of
bucket arrays (a thread-local), and a scrape adds the shards up. A shard is only ever written
by its thread, so no increment is lost; a scrape that copies a shard while its thread writes
sees that call or not, never a torn count. Shards of threads that ended are folded into one
and dropped at the next scrape. (With a lock per call this cost ~0.9 us here, a third of it
the lock; the shard lookup costs ~50 ns.)"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Sequence

from kvpool.metrics.catalogue import POOL_OPS
from kvpool.metrics.histogram import LATENCY_BUCKETS, LatencyHistogram

#: Per label values: (bucket counts, sum).
Series = dict[tuple[str, ...], tuple[list[int], float]]
#: One thread's histograms: per op, (the op's, its tiers' in read order).
_Shard = dict[str, tuple[LatencyHistogram, list[LatencyHistogram]]]


class OpLatency:
    """``labels``: the tiers' metric labels in read order. Every method is thread-safe and
    never raises."""

    def __init__(self, labels: Sequence[str]) -> None:
        self._labels = list(labels)
        self._local = threading.local()
        self._lock = threading.Lock()  # guards the shard list, never taken by a record
        self._shards: list[tuple[threading.Thread, _Shard]] = []
        self._retired = self._new_shard()  # what threads that ended recorded

    def _new_shard(self) -> _Shard:
        return {op: (LatencyHistogram(), [LatencyHistogram() for _ in self._labels])
                for op in POOL_OPS}

    def _my_shard(self) -> _Shard:
        shard: _Shard | None = getattr(self._local, "shard", None)
        if shard is None:
            shard = self._local.shard = self._new_shard()
            with self._lock:
                self._shards.append((threading.current_thread(), shard))
        return shard

    def record(self, op: str, seconds: float, timings: Sequence[float]) -> None:
        """One call of ``op`` took ``seconds``; ``timings[i]`` is how long tier i took (a
        call asks tiers in order from the first, so the list covers the tiers it asked)."""
        shard: _Shard | None = getattr(self._local, "shard", None)  # inline: every call
        total, tiers = (shard if shard is not None else self._my_shard())[op]
        total.counts[bisect_left(LATENCY_BUCKETS, seconds)] += 1
        total.total += seconds
        i = 0
        for tier_seconds in timings:  # an index loop: zip() costs 2-3x as much here
            hist = tiers[i]
            hist.counts[bisect_left(LATENCY_BUCKETS, tier_seconds)] += 1
            hist.total += tier_seconds
            i += 1  # noqa: SIM113 (enumerate costs like zip here)

    def record_at(self, op: str, seconds: float, timings: Sequence[tuple[int, float]]) -> None:
        """``record`` for a call that asked some tiers only: (tier index, seconds) each."""
        total, tiers = self._my_shard()[op]
        total.observe(seconds)
        for index, tier_seconds in timings:
            tiers[index].observe(tier_seconds)

    def snapshot(self) -> tuple[Series, Series]:
        """(per op, per (tier, op)) bucket counts and sums, over every thread; series never
        observed are left out of the tier map, so a scrape shows the tiers a pool used."""
        with self._lock:
            ended = [shard for thread, shard in self._shards if not thread.is_alive()]
            self._shards = [(t, shard) for t, shard in self._shards if t.is_alive()]
            for shard in ended:
                _add_into(self._retired, shard)
            shards = [self._retired, *(shard for _, shard in self._shards)]
            merged = self._new_shard()
            for shard in shards:
                _add_into(merged, shard)
        ops: Series = {(op,): total.snapshot() for op, (total, _) in merged.items()}
        tiers: Series = {(label, op): h.snapshot()
                         for op, (_, hists) in merged.items()
                         for label, h in zip(self._labels, hists, strict=True)
                         if any(h.counts)}
        return ops, tiers


def _add_into(into: _Shard, shard: _Shard) -> None:
    for op, (total, tiers) in shard.items():
        into_total, into_tiers = into[op]
        into_total.add(total)
        for mine, theirs in zip(into_tiers, tiers, strict=True):
            mine.add(theirs)


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
