"""Counter increases and histogram quantiles between two scrapes of one endpoint.

The rules are Prometheus' own, so a figure here matches what ``increase()`` and
``histogram_quantile()`` give on the dashboard over the same interval: a counter that went
down was reset (the process restarted) and counts from zero; a quantile is interpolated
linearly inside the bucket that holds its rank, the first bucket starting at 0, and a rank in
the ``+Inf`` bucket reports the largest finite bound. Every function returns None where
Prometheus would give no figure (NaN or no data): the view shows ``-``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from kvpool.monitor.scrape import Scrape

__all__ = ["counter_increase", "histogram_quantile", "interval_quantile", "rate"]


def counter_increase(before: Scrape, after: Scrape, name: str, **match: str) -> float | None:
    """How much the series of ``name`` matching ``match`` (summed) grew from ``before`` to
    ``after``; None if either scrape is down or ``after`` lacks the metric.

    Each series is taken alone, so one restarted series does not hide another's growth; a
    series ``before`` lacks (its labels first used in between) grew from 0.
    """
    if not (before.up and after.up) or not after.has(name):
        return None
    old = before.series(name)
    want = match.items()
    grown = 0.0
    for labels, value in after.series(name).items():
        if not want <= dict(labels).items():
            continue
        prev = old.get(labels, 0.0)
        grown += value if value < prev else value - prev
    return grown


def rate(before: Scrape, after: Scrape, name: str, **match: str) -> float | None:
    """:func:`counter_increase` per second of the interval between the two scrapes; None
    where the increase is None or the interval is not positive."""
    grown = counter_increase(before, after, name, **match)
    seconds = after.at - before.at
    if grown is None or seconds <= 0:
        return None
    return grown / seconds


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """The ``q``-quantile of a classic histogram given as ``(upper bound, cumulative count)``
    pairs (any order; equal bounds are added), as Prometheus computes it.

    None if there are fewer than two buckets, no ``+Inf`` bucket, or no observations.
    Cumulative counts that go down (a scrape racing an observation) are raised to their
    predecessor's, as Prometheus does. Raises ValueError for ``q`` outside [0, 1].
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} is outside [0, 1]")
    merged: dict[float, float] = {}
    for upper, count in buckets:
        merged[upper] = merged.get(upper, 0.0) + count
    bounds = sorted(merged)
    if len(bounds) < 2 or not math.isinf(bounds[-1]):
        return None
    counts = [merged[b] for b in bounds]
    for i in range(1, len(counts)):
        counts[i] = max(counts[i], counts[i - 1])
    observations = counts[-1]
    if observations <= 0:
        return None
    rank = q * observations
    # The first bucket (of all but +Inf) whose cumulative count reaches the rank.
    b = next((i for i in range(len(bounds) - 1) if counts[i] >= rank), len(bounds) - 1)
    if b == len(bounds) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start, end, count = 0.0, bounds[b], counts[b]
    if b > 0:
        start = bounds[b - 1]
        count -= counts[b - 1]
        rank -= counts[b - 1]
    return start + (end - start) * (rank / count)


def interval_quantile(q: float, before: Scrape, after: Scrape, name: str,
                      **match: str) -> float | None:
    """The ``q``-quantile of what histogram ``name`` observed between the two scrapes, over
    its series whose labels include ``match`` (their buckets added by ``le``, as
    ``sum by (le) (increase(name_bucket[..]))``); None if nothing was observed, either scrape
    is down or ``after`` lacks the histogram."""
    bucket = f"{name}_bucket"
    if not (before.up and after.up) or not after.has(bucket):
        return None
    old = before.series(bucket)
    want = match.items()
    grown: dict[float, float] = {}
    for labels, value in after.series(bucket).items():
        label_map = dict(labels)
        if "le" not in label_map or not want <= label_map.items():
            continue
        prev = old.get(labels, 0.0)
        upper = float(label_map["le"])
        grown[upper] = grown.get(upper, 0.0) + (value if value < prev else value - prev)
    return histogram_quantile(q, grown.items())
