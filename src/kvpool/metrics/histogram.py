"""A latency histogram cheap enough for every KVPool call, exported in Prometheus' form.

prometheus-client's Histogram takes a lock per bucket counter and per sum (~0.9 us an
observation here); a pool call records a handful of observations and counters at once, so
kvpool's histograms are plain bucket arrays that their owner updates under the one lock it
takes per call (PoolMetrics, ServerMetrics), and only the collector turns them into
cumulative Prometheus buckets at scrape time.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from prometheus_client.core import HistogramMetricFamily

#: Upper bounds (seconds): 10 us .. 10 s, about 2.5x apart, then +Inf.
LATENCY_BUCKETS: tuple[float, ...] = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5, 5.0, 10.0)


class LatencyHistogram:
    """Bucket counts and a sum. Not thread-safe by itself: one thread writes it (or its
    owner holds a lock around ``observe``)."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)  # the last is +Inf
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bucket (le = "<=").
        self.counts[bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total += seconds

    def snapshot(self) -> tuple[list[int], float]:
        return list(self.counts), self.total

    def add(self, other: LatencyHistogram) -> None:
        """Add ``other``'s observations (a copy of its counts is taken first: its owner may
        be writing them)."""
        counts, total = other.snapshot()
        self.counts = [a + b for a, b in zip(self.counts, counts, strict=True)]
        self.total += total


def histogram_family(name: str, help_text: str, labels: Sequence[str],
                     series: dict[tuple[str, ...], tuple[list[int], float]]
                     ) -> HistogramMetricFamily:
    """One Prometheus histogram family from per-label-values (counts, sum) snapshots."""
    family = HistogramMetricFamily(name, help_text, labels=list(labels))
    bounds = [*(repr(b) for b in LATENCY_BUCKETS), "+Inf"]
    for values, (counts, total) in series.items():
        acc = 0
        buckets = []
        for bound, n in zip(bounds, counts, strict=True):
            acc += n
            buckets.append((bound, float(acc)))
        family.add_metric(list(values), buckets, total)
    return family
