"""Every metric kvpool exports: name, type, labels and help, in one table.

The collectors build their families from this table (so a name, its type and its labels
cannot drift apart between components), the docs list it, and the Grafana dashboard's test
checks its queries against it. Naming follows Prometheus conventions: ``_total`` counters,
``_seconds`` and ``_bytes`` units, bounded label values (tiers, ops, queues, node ids; never
key, request or namespace ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "gauge", "histogram"]

#: Label values of ``tier``.
TIERS = ("dram", "ssd_staging", "ssd", "cluster_staging", "remote")
#: Label values of ``op`` on pool and tier latency.
POOL_OPS = ("get", "put", "lookup")
#: Label values of ``queue``.
QUEUES = ("ssd_write_behind", "cluster_write_behind", "mover")
#: Label values of ``cause`` on dropped saves.
DROP_CAUSES = ("full", "write_error", "pinned", "node_down", "budget", "fill_error",
               "commit_error", "aborted")


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    #: Which components export it: "pool" (every process with a KVPool), "server", "engine".
    component: str = "pool"


def _specs() -> list[MetricSpec]:
    s, e = "server", "engine"
    return [
        MetricSpec("kvpool_lookups_total", "counter", "KVPool.lookup calls."),
        MetricSpec("kvpool_lookup_hit_chunks_total", "counter",
                   "Chunks those lookups found (the leading run of the prefix)."),
        MetricSpec("kvpool_hit_chunks_total", "counter",
                   "Chunks read, by the tier that served them.", ("tier",)),
        MetricSpec("kvpool_hit_tokens_total", "counter",
                   "Tokens of the chunks read (chunks x chunk tokens), by tier.", ("tier",)),
        MetricSpec("kvpool_miss_chunks_total", "counter", "Chunks asked for that no tier served."),
        MetricSpec("kvpool_miss_tokens_total", "counter", "Tokens of the chunks no tier served."),
        MetricSpec("kvpool_read_bytes_total", "counter", "Payload bytes read from each tier.",
                   ("tier",)),
        MetricSpec("kvpool_written_bytes_total", "counter",
                   "Payload bytes each tier accepted from puts.", ("tier",)),
        MetricSpec("kvpool_op_seconds", "histogram",
                   "KVPool call latency, end to end: get = get_many_into, put = put_many or "
                   "commit_many, lookup.", ("op",)),
        MetricSpec("kvpool_tier_op_seconds", "histogram",
                   "One tier's part of a KVPool call.", ("tier", "op")),
        MetricSpec("kvpool_evictions_total", "counter",
                   "Chunks evicted: DRAM arena evictions; SSD records dropped with their "
                   "segment.", ("tier",)),
        MetricSpec("kvpool_ssd_segments_evicted_total", "counter", "SSD segments freed."),
        MetricSpec("kvpool_ssd_copied_forward_total", "counter",
                   "Records copied forward when their SSD segment was evicted."),
        MetricSpec("kvpool_ssd_hot_dropped_total", "counter",
                   "Records read since written (DRAM hits and replica touches included) "
                   "dropped with their SSD segment because they exceeded "
                   "ssd.copy_forward_fraction."),
        MetricSpec("kvpool_ssd_written_back_total", "counter",
                   "DRAM chunks written back to the SSD because their SSD record was evicted "
                   "while DRAM held them: DRAM victims, and hot records the copy-forward cap "
                   "dropped."),
        MetricSpec("kvpool_ssd_write_amplification", "gauge",
                   "Record bytes written to the SSD log (headers, padding, copy-forward) / "
                   "payload bytes put; 0 before the first put."),
        MetricSpec("kvpool_promotions_total", "counter",
                   "Chunks moved up into DRAM after a read found them below."),
        MetricSpec("kvpool_prefetched_total", "counter",
                   "Chunks moved up into DRAM by prefetch or lookup read-ahead."),
        MetricSpec("kvpool_warmed_total", "counter",
                   "Chunks moved up into DRAM from the SSD when their namespace was registered "
                   "(pool.warm_start_fraction)."),
        MetricSpec("kvpool_demotions_total", "counter",
                   "DRAM victims handed to the SSD write-behind queue."),
        MetricSpec("kvpool_checksum_failures_total", "counter",
                   "Records that failed verification (each a miss).", ("tier",)),
        MetricSpec("kvpool_io_errors_total", "counter", "Media IO errors, reads and writes.",
                   ("tier",)),
        MetricSpec("kvpool_dropped_saves_total", "counter",
                   "Saves dropped: full (staging full), write_error, pinned (DRAM had no "
                   "evictable slot), node_down (no storage node took it); of KVPool.save "
                   "(tier dram): budget (over pool.save_budget_bytes), pinned (no free slot), "
                   "fill_error (the engine's gather failed), commit_error, aborted.",
                   ("tier", "cause")),
        MetricSpec("kvpool_queue_depth", "gauge", "Chunks (mover: jobs) queued.", ("queue",)),
        MetricSpec("kvpool_queue_bytes", "gauge",
                   "Payload bytes queued in a write-behind queue (being written included).",
                   ("queue",)),
        MetricSpec("kvpool_capacity_bytes", "gauge", "Capacity of a tier.", ("tier",)),
        MetricSpec("kvpool_used_bytes", "gauge", "Bytes in use in a tier.", ("tier",)),
        MetricSpec("kvpool_chunks", "gauge", "Chunks a tier holds.", ("tier",)),
        MetricSpec("kvpool_read_directory_chunks", "gauge",
                   "DRAM chunks a host pool's read directory shows its attached engines, "
                   "which read them without asking (host.direct_reads)."),
        MetricSpec("kvpool_read_directory_full_total", "counter",
                   "DRAM chunks the read directory had no room for (a full bucket): their "
                   "reads ask the host pool; raise host.directory_entries."),
        MetricSpec("kvpool_node_up", "gauge",
                   "1 if this client sees the storage node live, 0 if it marked it down.",
                   ("node",)),
        MetricSpec("kvpool_remote_errors_total", "counter",
                   "Failed requests to storage nodes (each a miss or a dropped save)."),
        MetricSpec("kvpool_server_connections", "gauge", "Connections open now.", (), s),
        MetricSpec("kvpool_server_connections_accepted_total", "counter",
                   "Connections accepted.", (), s),
        MetricSpec("kvpool_server_requests_total", "counter", "Requests served, by op.",
                   ("op",), s),
        MetricSpec("kvpool_server_request_seconds", "histogram",
                   "Time from a request's header to its answer, by op.", ("op",), s),
        MetricSpec("kvpool_server_auth_failures_total", "counter", "Failed AUTH requests.",
                   (), s),
        MetricSpec("kvpool_server_protocol_errors_total", "counter",
                   "Connections closed for a malformed frame.", (), s),
        MetricSpec("kvpool_server_busy_total", "counter",
                   "Requests and connections refused BUSY (over server limits).", (), s),
        MetricSpec("kvpool_server_draining", "gauge",
                   "1 while the node is drained (kvpool admin drain): no new chunks.", (), s),
        MetricSpec("kvpool_cluster_nodes", "gauge",
                   "Nodes of the cluster by state as this node sees etcd: live, missing "
                   "(expected but not registered; kvpool admin forget removes one), draining. "
                   "A node without etcd counts itself, live.",
                   ("state",), s),
        MetricSpec("kvpool_repair_chunks_total", "counter",
                   "Chunks copied to a replica that lacked them: kind=read (a client's read "
                   "repair), rereplicate (a node, after a membership change), drain (a "
                   "drained node emptying itself).", ("kind",), s),
        MetricSpec("kvpool_repair_bytes_total", "counter",
                   "Bytes of the chunks kvpool_repair_chunks_total counts.", (), s),
        MetricSpec("kvpool_repair_pending_chunks", "gauge",
                   "Chunks a node found a peer lacking and has not copied yet.", (), s),
        MetricSpec("kvpool_repair_failures_total", "counter",
                   "Repair copies that failed (peer down or refusing, read error) or were "
                   "dropped (a client's full read-repair queue).", (), s),
        MetricSpec("kvpool_repair_passes_total", "counter",
                   "Repair passes a node made over its chunks (after it started, after each "
                   "membership change: a join, a leave, a restarted peer, a drain).", (), s),
        MetricSpec("kvpool_events_published_total", "counter",
                   "KV events published (docs/routing.md), by medium: CPU (DRAM), DISK (SSD).",
                   ("medium",)),
        MetricSpec("kvpool_events_batches_total", "counter",
                   "KV event batches sent on the PUB socket."),
        MetricSpec("kvpool_events_dropped_total", "counter",
                   "KV events dropped (queue full, send failed): each loss shows consumers a "
                   "sequence gap."),
        MetricSpec("kvpool_events_replays_total", "counter",
                   "Replay requests answered (consumers catching up after a gap)."),
        MetricSpec("kvpool_pinned_bytes", "gauge",
                   "Bytes of chunks saved with retention priority pin whose pin holds."),
        MetricSpec("kvpool_pinned_limit_bytes", "gauge",
                   "Bound on kvpool_pinned_bytes: pool.max_pinned_fraction of dram.capacity."),
        MetricSpec("kvpool_pins_refused_total", "counter",
                   "Saves refused because their pins would pass kvpool_pinned_limit_bytes "
                   "(PinLimitError; a node's RETAIN answered PIN_LIMIT)."),
        MetricSpec("kvpool_expired_chunks_total", "counter",
                   "Chunks whose retention TTL passed (misses from then on)."),
        MetricSpec("kvpool_tenant_bytes", "gauge",
                   "Bytes a tenant's chunks hold, by tier (dram; ssd as written by this "
                   "pool); only tenants with a quota in pool.tenant_quotas.",
                   ("tenant", "tier")),
        MetricSpec("kvpool_tenant_quota_bytes", "gauge",
                   "A tenant's quota (pool.tenant_quotas), by tier; absent: unbounded.",
                   ("tenant", "tier")),
        MetricSpec("kvpool_tenant_quota_drops_total", "counter",
                   "Saves of a tenant at its DRAM quota dropped because none of its own "
                   "chunks could be evicted for them.", ("tenant",)),
        MetricSpec("kvpool_tenant_quota_evictions_total", "counter",
                   "A tenant's own SSD chunks deleted to keep it within its SSD quota.",
                   ("tenant",)),
        MetricSpec("kvpool_build_info", "gauge",
                   "Always 1; the version label is the kvpool package's version.",
                   ("version",), s),
        MetricSpec("kvpool_engine_lookup_tokens_total", "counter",
                   "Prompt tokens the engine looked up, result hit or miss.",
                   ("engine", "result"), e),
        MetricSpec("kvpool_engine_prefill_tokens_saved_total", "counter",
                   "Tokens loaded from kvpool instead of computed.", ("engine",), e),
        MetricSpec("kvpool_engine_stored_tokens_total", "counter",
                   "Tokens the engine saved into kvpool (chunks accepted x chunk tokens).",
                   ("engine",), e),
        MetricSpec("kvpool_engine_ttft_seconds", "histogram",
                   "Time to first token, measured by the integration (HF; vLLM exports "
                   "vllm:time_to_first_token_seconds itself).", ("engine",), e),
    ]


METRICS: dict[str, MetricSpec] = {spec.name: spec for spec in _specs()}


def all_metric_names(component: str | None = None) -> list[str]:
    """Every metric name kvpool exports (of one component: pool, server or engine)."""
    return [m.name for m in METRICS.values() if component is None or m.component == component]
