"""Turns a KVPool's ``stats()`` into the pool metrics of catalogue.py at scrape time: the
tiers count what they do anyway, so counters cost the data path nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvpool.errors import PoolClosedError
from kvpool.metrics.families import Families
from kvpool.metrics.recorder import OpLatency
from kvpool.tiers.base import hit_counts

Stats = dict[str, Any]



def _get(stats: Stats, *path: str) -> Any:
    node: Any = stats
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


class PoolCollector(Collector):
    """Collects from ``stats`` (KVPool.stats) and ``latency()`` (None: no histograms).
    ``tiers``: the pool's tiers as (name, label): the pool counts a tier's reads under its
    name (``hit_counts``), the metrics label them. A pool that is closed yields nothing."""

    def __init__(self, stats: Callable[[], Stats],
                 latency: Callable[[], OpLatency | None],
                 tiers: Sequence[tuple[str, str]]) -> None:
        self._stats = stats
        self._latency = latency
        self._tiers = list(tiers)

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._stats()
        except PoolClosedError:
            return iter(())
        out = Families()
        pool_counters(out, stats, self._tiers)
        tier_counters(out, stats)
        remote_metrics(out, stats)
        retention_metrics(out, stats)
        latency = self._latency()
        if latency is not None:
            ops, tiers = latency.snapshot()
            out.add_histogram("kvpool_op_seconds", ops)
            out.add_histogram("kvpool_tier_op_seconds", tiers)
        return iter(out)


def pool_counters(out: Families, stats: Stats, tiers: Sequence[tuple[str, str]]) -> None:
    pool = stats["pool"]
    out.add("kvpool_lookups_total", pool["lookups"])
    out.add("kvpool_lookup_hit_chunks_total", pool["lookup_hit_chunks"])
    for name, tier in tiers:
        chunks, nbytes, tokens = hit_counts(name)
        out.add("kvpool_hit_chunks_total", pool.get(chunks, 0), tier)
        out.add("kvpool_hit_tokens_total", pool.get(tokens, 0), tier)
        out.add("kvpool_read_bytes_total", pool.get(nbytes, 0), tier)
    out.add("kvpool_miss_chunks_total", pool["misses"])
    out.add("kvpool_miss_tokens_total", pool.get("miss_tokens", 0))
    out.add("kvpool_promotions_total", pool["promotions"])
    out.add("kvpool_prefetched_total", pool["prefetched"])
    out.add("kvpool_warmed_total", pool["warmed"])
    out.add("kvpool_demotions_total", pool.get("demotions", 0))
    out.add("kvpool_ssd_written_back_total", pool.get("written_back", 0))
    out.add("kvpool_queue_depth", pool.get("mover_pending", 0), "mover")


def tier_counters(out: Families, stats: Stats) -> None:
    dram = stats.get("dram")
    if dram is not None:
        out.add("kvpool_written_bytes_total", dram["put_bytes"], "dram")
        out.add("kvpool_evictions_total", dram["evictions"], "dram")
        saves = stats.get("saves", {})
        out.add("kvpool_dropped_saves_total",
                dram["dropped_puts"] + saves.get("save_dropped_no_slot", 0), "dram", "pinned")
        for cause, key in (("budget", "save_dropped_budget"), ("fill_error", "save_dropped_fill"),
                           ("commit_error", "save_dropped_commit"),
                           ("aborted", "save_dropped_aborted")):
            out.add("kvpool_dropped_saves_total", saves.get(key, 0), "dram", cause)
        out.add("kvpool_capacity_bytes", dram["capacity_bytes"], "dram")
        out.add("kvpool_used_bytes", dram["used_bytes"], "dram")
        out.add("kvpool_chunks", dram["entries"], "dram")
        if "directory_entries" in dram:  # a host pool's tenant pool (tiers/directory.py)
            out.add("kvpool_read_directory_chunks", dram["directory_entries"])
            out.add("kvpool_read_directory_full_total", dram["directory_full"])
    for path, tier, queue, error_cause in ((("write_behind",), "ssd_staging",
                                            "ssd_write_behind", "write_error"),
                                           (("remote", "write_behind"), "cluster_staging",
                                            "cluster_write_behind", "node_down")):
        staging = _get(stats, *path)
        if staging is None:
            continue
        out.add("kvpool_written_bytes_total", staging["offered_bytes"], tier)
        out.add("kvpool_dropped_saves_total", staging["dropped"], tier, "full")
        out.add("kvpool_dropped_saves_total", staging["write_errors"], tier, error_cause)
        out.add("kvpool_queue_depth", staging["queued"], queue)
        out.add("kvpool_queue_bytes", staging["queued_bytes"], queue)
    ssd = stats.get("ssd")
    if ssd is not None:
        out.add("kvpool_written_bytes_total", ssd["put_bytes"], "ssd")
        out.add("kvpool_evictions_total", ssd["records_evicted"], "ssd")
        out.add("kvpool_ssd_segments_evicted_total", ssd["segments_evicted"])
        out.add("kvpool_ssd_copied_forward_total", ssd["copied_forward"])
        out.add("kvpool_ssd_hot_dropped_total", ssd.get("hot_dropped", 0))
        put_bytes = ssd["put_bytes"]
        out.add("kvpool_ssd_write_amplification",
                ssd.get("log_bytes", 0) / put_bytes if put_bytes else 0.0)
        out.add("kvpool_checksum_failures_total", ssd["checksum_failures"], "ssd")
        out.add("kvpool_io_errors_total", ssd["io_errors"] + ssd.get("write_errors", 0), "ssd")
        out.add("kvpool_capacity_bytes", ssd["capacity_bytes"], "ssd")
        out.add("kvpool_used_bytes", ssd["used_bytes"], "ssd")
        out.add("kvpool_chunks", ssd["records"], "ssd")


def retention_metrics(out: Families, stats: Stats) -> None:
    """Pins, TTL expiries and tenant quotas (retention/)."""
    retention = stats.get("retention")
    if retention is None:
        return
    out.add("kvpool_pinned_bytes", retention["pinned_bytes"])
    out.add("kvpool_pinned_limit_bytes", retention["max_pinned_bytes"])
    out.add("kvpool_pins_refused_total", retention["pins_refused"])
    out.add("kvpool_expired_chunks_total", retention["expired"])
    for tenant, t in retention["tenants"].items():
        if t["dram_quota_bytes"] is None and t["ssd_quota_bytes"] is None:
            continue  # series only for the configured tenants: bounded label values
        for tier in ("dram", "ssd"):
            out.add("kvpool_tenant_bytes", t[f"{tier}_bytes"], tenant, tier)
            if t[f"{tier}_quota_bytes"] is not None:
                out.add("kvpool_tenant_quota_bytes", t[f"{tier}_quota_bytes"], tenant, tier)
        out.add("kvpool_tenant_quota_drops_total", t["quota_drops"], tenant)
        out.add("kvpool_tenant_quota_evictions_total", t["ssd_quota_evictions"], tenant)


def remote_metrics(out: Families, stats: Stats) -> None:
    client = _get(stats, "remote", "client")
    if client is None:
        return
    out.add("kvpool_written_bytes_total", client.get("put_bytes", 0), "remote")
    out.add("kvpool_remote_errors_total", client.get("remote_errors", 0))
    if "read_repair_chunks" in client:  # a client's read repair (net/read_repair.py)
        out.add("kvpool_repair_chunks_total", client["read_repair_chunks"], "read")
        out.add("kvpool_repair_bytes_total", client.get("read_repair_bytes", 0))
        out.add("kvpool_repair_failures_total", client.get("read_repair_failures", 0)
                + client.get("read_repair_dropped", 0))
    down = set(client.get("down_nodes", ()))
    for node in sorted(set(client.get("live_nodes", ())) | down):
        out.add("kvpool_node_up", 0 if node in down else 1, node)
