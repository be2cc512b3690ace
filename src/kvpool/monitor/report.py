"""One endpoint's figures, per tier, from two scrapes of it (the metric names of issue 12).

:func:`endpoint_report` returns a JSON-ready dict; every figure that cannot be had (the
endpoint lacks the metric, the first scrape failed, nothing happened in the interval to take a
ratio or a quantile of) is None, shown as ``-``. A down endpoint is ``{"up": False, "error":
...}``, never an exception. Rates are per second of the interval between the two scrapes;
counts (evictions, errors, dropped saves) are what happened in it. GB are 10^9 bytes.
"""

from __future__ import annotations

from typing import Any

from kvpool.monitor.maths import counter_increase, interval_quantile, rate
from kvpool.monitor.scrape import Scrape

__all__ = ["endpoint_report"]

# Metrics with a ``tier`` label: a tier is listed when any of them is not 0 for it.
_TIER_METRICS = ("kvpool_hit_chunks_total", "kvpool_read_bytes_total",
                 "kvpool_written_bytes_total", "kvpool_tier_op_seconds_bucket",
                 "kvpool_evictions_total", "kvpool_checksum_failures_total",
                 "kvpool_io_errors_total", "kvpool_dropped_saves_total",
                 "kvpool_capacity_bytes", "kvpool_used_bytes", "kvpool_chunks")
_GB = 1e9


def endpoint_report(before: Scrape, after: Scrape) -> dict[str, Any]:
    """The figures of one endpoint between ``before`` and ``after`` (two scrapes of the same
    URL, ``after`` the later). ``kind`` is ``node`` (it serves the node metrics), ``engine``
    (it serves engine metrics) or ``pool``; sections a kind lacks are left out."""
    if not after.up:
        return {"url": after.url, "up": False, "error": after.error}
    report: dict[str, Any] = {
        "url": after.url, "up": True, "kind": _kind(after),
        "interval_s": after.at - before.at if before.up else None,
        "overall": _overall(before, after),
        "tiers": {tier: _tier(before, after, tier) for tier in _tiers(after)},
        "queues": {q: {"depth": after.total("kvpool_queue_depth", queue=q),
                       "bytes": after.total("kvpool_queue_bytes", queue=q)}
                   for q in sorted(after.label_values("kvpool_queue_depth", "queue")
                                   | after.label_values("kvpool_queue_bytes", "queue"))},
    }
    nodes = after.series("kvpool_node_up")
    if nodes:
        report["nodes_seen"] = {dict(labels).get("node", ""): bool(value)
                                for labels, value in sorted(nodes.items())}
    if report["kind"] == "node":
        report["server"] = _server(before, after)
    elif report["kind"] == "engine":
        report["engine"] = _engine(before, after)
    return report


def _kind(scrape: Scrape) -> str:
    if scrape.has("kvpool_server_connections"):
        return "node"
    if any(name.startswith("kvpool_engine_") for name in scrape.samples):
        return "engine"
    return "pool"


def _tiers(scrape: Scrape) -> list[str]:
    """The tiers with anything to show: a pool exports every tier's counters, zeros for the
    tiers it lacks (a node has no cluster staging), and those rows would be noise."""
    names: set[str] = set()
    for metric in _TIER_METRICS:
        names |= {dict(labels).get("tier", "") for labels, value in scrape.series(metric).items()
                  if value}
    names.discard("")
    return sorted(names, key=lambda t: (_TIER_ORDER.get(t, len(_TIER_ORDER)), t))


_TIER_ORDER = {t: i for i, t in enumerate(("dram", "ssd_staging", "ssd", "cluster_staging",
                                           "remote"))}


def _asked(before: Scrape, after: Scrape) -> float | None:
    """Chunks asked in the interval: every tier's hits plus the misses."""
    hits = counter_increase(before, after, "kvpool_hit_chunks_total")
    misses = counter_increase(before, after, "kvpool_miss_chunks_total")
    if hits is None and misses is None:
        return None
    return (hits or 0.0) + (misses or 0.0)


def _ratio(part: float | None, whole: float | None) -> float | None:
    return part / whole if part is not None and whole else None


def _overall(before: Scrape, after: Scrape) -> dict[str, Any]:
    asked = _asked(before, after)
    hits_ever = after.total("kvpool_hit_chunks_total")
    misses_ever = after.total("kvpool_miss_chunks_total")
    asked_ever = None if hits_ever is None and misses_ever is None else \
        (hits_ever or 0.0) + (misses_ever or 0.0)
    return {
        "hit_rate": _ratio(counter_increase(before, after, "kvpool_hit_chunks_total"), asked),
        "chunks_asked": asked,
        "hit_rate_since_start": _ratio(hits_ever, asked_ever),
        "lookups_per_s": rate(before, after, "kvpool_lookups_total"),
        **_latencies(before, after, "kvpool_op_seconds", ("get", "put", "lookup")),
        "remote_errors": counter_increase(before, after, "kvpool_remote_errors_total"),
    }


def _latencies(before: Scrape, after: Scrape, histogram: str, ops: tuple[str, ...],
               **match: str) -> dict[str, float | None]:
    return {f"{op}_p{q}_s": interval_quantile(q / 100, before, after, histogram, op=op,
                                              **match)
            for op in ops for q in (50, 99)}


def _tier(before: Scrape, after: Scrape, tier: str) -> dict[str, Any]:
    def grown(name: str, **match: str) -> float | None:
        return counter_increase(before, after, name, tier=tier, **match)

    def gbps(name: str) -> float | None:
        per_s = rate(before, after, name, tier=tier)
        return per_s / _GB if per_s is not None else None

    hits = grown("kvpool_hit_chunks_total")
    used, capacity = after.total("kvpool_used_bytes", tier=tier), \
        after.total("kvpool_capacity_bytes", tier=tier)
    checksum, io = grown("kvpool_checksum_failures_total"), grown("kvpool_io_errors_total")
    errors = [e for e in (checksum, io) if e is not None]
    if tier == "remote":  # failed requests to the nodes: the remote tier's own errors
        remote = counter_increase(before, after, "kvpool_remote_errors_total")
        errors += [remote] if remote is not None else []
    causes = after.label_values("kvpool_dropped_saves_total", "cause")
    return {
        "hit_rate": _ratio(hits, _asked(before, after)),
        "hit_chunks": hits,
        "read_gbps": gbps("kvpool_read_bytes_total"),
        "write_gbps": gbps("kvpool_written_bytes_total"),
        **_latencies(before, after, "kvpool_tier_op_seconds", ("get", "put"), tier=tier),
        "used_bytes": used,
        "capacity_bytes": capacity,
        "used_fraction": _ratio(used, capacity),
        "chunks": after.total("kvpool_chunks", tier=tier),
        "evictions": grown("kvpool_evictions_total"),
        "checksum_failures": checksum,
        "io_errors": io,
        "errors": sum(errors) if errors else None,
        "dropped_saves": grown("kvpool_dropped_saves_total"),
        "dropped_by_cause": {c: grown("kvpool_dropped_saves_total", cause=c)
                             for c in sorted(causes)},
    }


def _server(before: Scrape, after: Scrape) -> dict[str, Any]:
    return {
        "connections": after.total("kvpool_server_connections"),
        "requests_per_s": rate(before, after, "kvpool_server_requests_total"),
        "request_p50_s": interval_quantile(0.5, before, after, "kvpool_server_request_seconds"),
        "request_p99_s": interval_quantile(0.99, before, after,
                                           "kvpool_server_request_seconds"),
        "auth_failures": counter_increase(before, after, "kvpool_server_auth_failures_total"),
        "protocol_errors": counter_increase(before, after,
                                            "kvpool_server_protocol_errors_total"),
        "busy": counter_increase(before, after, "kvpool_server_busy_total"),
        "draining": after.total("kvpool_server_draining"),
    }


def _engine(before: Scrape, after: Scrape) -> dict[str, Any]:
    looked_up = counter_increase(before, after, "kvpool_engine_lookup_tokens_total")
    return {
        "token_hit_rate": _ratio(counter_increase(before, after,
                                                  "kvpool_engine_lookup_tokens_total",
                                                  result="hit"), looked_up),
        "prefill_tokens_saved": counter_increase(before, after,
                                                 "kvpool_engine_prefill_tokens_saved_total"),
        "stored_tokens": counter_increase(before, after, "kvpool_engine_stored_tokens_total"),
        "ttft_p50_s": interval_quantile(0.5, before, after, "kvpool_engine_ttft_seconds"),
        "ttft_p99_s": interval_quantile(0.99, before, after, "kvpool_engine_ttft_seconds"),
    }
