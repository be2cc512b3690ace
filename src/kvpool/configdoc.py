"""Renders the settings models as documentation: every knob, its default and its meaning.

``docs/config.md`` is ``config_markdown()`` (``kvpool config --doc``); tests/test_config.py
fails when the two differ, or when a field has no description.
"""

from __future__ import annotations

from pydantic import BaseModel

from kvpool.config import Config
from kvpool.integrations.vllm.settings import EXTRA_CONFIG, ConnectorSettings

#: Keys that were removed, and why; a file that still sets one is refused (unknown key).
REMOVED_KEYS = {
    "pool.chunk_tokens": "nothing read it: `PrefixCache(chunk_tokens=)` and the vLLM "
                         f"connector (`{EXTRA_CONFIG}.chunk_tokens`) set their own chunk size",
}


#: YRCloudFile's tuning knobs and what each one is in kvpool (issue 12 item 4).
YRCLOUDFILE_SECTION = [
    "## YRCloudFile's knobs",
    "",
    "kvpool follows YRCloudFile's KVCache tuning guide; each of its knobs maps onto the keys",
    "above as follows, and where one cannot apply the table says so instead of faking it.",
    "",
    "| YRCloudFile | kvpool | notes |",
    "| --- | --- | --- |",
    "| `warm_cache_ratio` | `dram.warm_cache_ratio` | Share of host memory (MemTotal, or a "
    "lower cgroup memory limit) for the DRAM tier; resolves `dram.capacity` to whole "
    "`dram.slab_size` when the config loads (`kvpool config` prints the result); setting "
    "`dram.capacity` too is refused. Applies to a storage node and to an embedded pool alike: "
    "it sizes kvpool's own arena, never the engine's KV memory. Each process with a pool "
    "takes that share: with vLLM tensor parallelism every rank owns a pool, so divide the "
    "ratio by the ranks on one host. |",
    "| `prefetch_window` | `pool.prefetch_window_chunks`; vLLM: "
    f"`{EXTRA_CONFIG}.prefetch_window_tokens` | Tokens read ahead along a prefix: the vLLM "
    "connector's scheduler-side lookup moves the first this-many tokens of the cached prefix "
    "that DRAM lacks up from SSD / the nodes, a scheduler step before the load (tokens, "
    "rounded up to chunks; default `pool.prefetch_window_chunks` chunks). The HF "
    "integration does not read ahead: its load follows its lookup at once, where a read-ahead "
    "measured 25-50% slower (see `pool.prefetch_window_chunks`). |",
    f"| `offload_threshold` | vLLM: `{EXTRA_CONFIG}.offload_threshold` | vLLM owns its KV "
    "memory, but it hands the connector's scheduler side its block pool "
    "(`bind_gpu_block_pool`, vLLM 0.32): a request is saved only if the engine's KV usage "
    "(blocks in use / all blocks) is at least the threshold when its first chunk completes, "
    "the whole request or none of it. 0 (default) saves every request. A skipped request is "
    "not in kvpool after a restart, for other engines, or once vLLM evicts it. The HF "
    "integration has no such figure (transformers keeps no shared KV block pool) and always "
    "saves. It is a key of the connector's settings only: kvpool's YAML and `KVPOOL_*` "
    "variables cannot set it. |",
    "| `block_size` | none: 4096 bytes, fixed | SSD alignment. Every record starts on a 4 "
    "KiB boundary and the on-disk format counts in 4 KiB blocks (the index, segment "
    "summaries, recovery scans), so it is part of the format, not a tunable: a directory "
    "written at one alignment could not be read at another. 4096 satisfies O_DIRECT on "
    "every 512-byte and 4Kn device; a medium that needs more fails the aligned probe read "
    "at open (EINVAL) and `ssd.direct_io: auto` falls back to buffered IO with one warning "
    "(`on` refuses to start). Large IOs come from `ssd.segment_size`, `ssd.read_piece_bytes` "
    "and `ssd.coalesce_max_bytes` instead. |",
    "| reserve 20% of storage-node memory | start-up check of `kvpool serve` | One WARNING "
    "line (event `memory_reserve`, with the figures) when `dram.capacity` + 256 MiB of "
    "process overhead + `pool.write_behind_bytes` exceed 80% of the memory available "
    "(MemAvailable, or a lower cgroup limit minus its usage), checked before the arena is "
    "taken. It warns, it does not refuse: the operator may know better. |",
]

#: The events of the structured logs (issue 12 item 6).
LOG_EVENTS_SECTION = [
    "## Log events",
    "",
    "`kvpool serve` and `kvpool demo` configure logging from the `log` section (an embedded",
    "pool leaves its host process's logging alone unless `log.configure`). With",
    "`log.format: json` each line is one",
    "object: `ts`, `level`, `logger`, `event` (for a line that is none of these, its",
    "logger's name under `kvpool.`, e.g. `ssd`), `message` and the event's fields",
    "below. `kvpool serve`'s `listening` and `stopped` go to stdout, the rest to stderr.",
    "",
    "| event | level | logger | fields |",
    "| --- | --- | --- | --- |",
    "| `node_joined`, `node_left` | info | kvpool.cluster.etcd_membership | `cluster`, `node`, "
    "`address`: a client's etcd membership saw a node come or go (the first read included) |",
    "| `node_drained`, `node_undrained` | info | kvpool.cluster.etcd_membership | `cluster`, "
    "`node`: `kvpool admin drain` / `undrain` as a client's membership saw it (the first "
    "read included) |",
    "| `segment_evicted` | info | kvpool.ssd | `segment`, `records_dropped`, `hot_dropped` "
    "(of them, records read since written but over `ssd.copy_forward_fraction`), "
    "`copied_forward` |",
    "| `checksum_failure` | warning | kvpool.ssd | `segment`, `offset` (bytes into the "
    "segment), `key_prefix` (first 4 bytes, hex), `reason`, `held_back`: at most one line "
    "per 10 s, `held_back` failures since the last |",
    "| `auth_failure` | warning | kvpool.serve | `node`, `peer` (host:port), `held_back`: "
    "rate-limited like checksum_failure |",
    "| `memory_reserve` | warning | kvpool.serve | `dram_capacity`, `available` (bytes): see "
    "the reserve-20% row above |",
    "| `dropped_save` | warning | kvpool.writebehind | `queue` (ssd_staging, "
    "cluster_staging), `cause` (full), `dropped`: one line per burst (at most one per 10 s), "
    "`dropped` saves since the last |",
    "| `node_id_taken` | error | kvpool.cluster.registration | `node`, `holder` (address): "
    "the node lost its lease and another node (another cache_dir identity) holds its key "
    "now; the node stops, `kvpool serve` exits 2 |",
    "| `lease_lost`, `registered_again` | warning | kvpool.cluster.registration | `node`: "
    "the lease expired (etcd paused or cut off past the TTL); the node claims its key again |",
    "| `etcd_unreachable`, `etcd_reachable` | warning, info | kvpool.cluster.registration | "
    "`node`: the keepalive could not reach etcd (once per outage) / reached it again |",
    "| `deregister_failed` | warning | kvpool.cluster.registration | `node`: a stopping "
    "node could not remove its key; it expires after the TTL |",
    "| `node_incarnation` | info | kvpool.cluster | `node`: a client saw a node id come "
    "back as a new run (or at a new address) and closed its old connections |",
    "| `listening` | info | kvpool.status (stdout) | `node`, `host`, `port`, `pid`, "
    "`metrics_port`: `kvpool serve` serves |",
    "| `stopped` | info | kvpool.status (stdout) | `node`, `flushed` (the write-behind queue "
    "reached SSD), `seconds` (the stop took) |",
    "| `shutdown` | info | kvpool.serve | `node`, `cause` (SIGTERM, SIGINT), `inflight`, "
    "`timeout_s`; `phase: start-up` when the signal came before it served |",
    "| `shutdown_cut_requests`, `shutdown_flush_incomplete` | warning | kvpool.serve | "
    "`node`, `inflight`: the stop ran out of `server.shutdown_timeout_s` |",
    "| `config_reloaded` | info | kvpool.serve | `node`, `applied`, `restart_needed` "
    "(dotted keys): after SIGHUP |",
    "| `config_reload_failed`, `config_reload_ignored` | warning, info | kvpool.serve | "
    "the file did not load (settings kept); SIGHUP before the node listened |",
    "| `protocol_error` | info | kvpool.serve | `peer`, `held_back`: a connection closed "
    "for bytes that are not a frame; rate-limited like checksum_failure |",
    "| `tls_handshake_failed` | info | kvpool.serve | `peer`, `held_back`: a TLS "
    "handshake failed (a plain client, an unknown CA); rate-limited like protocol_error |",
    "| `internal_error` | error | kvpool.serve | `peer`: a connection closed after an "
    "unexpected error in the node (a bug; with its traceback) |",
    "| `read_repair_failed` | warning | kvpool.cluster | `node`: a read repair or hinted "
    "write raised in the client (a bug, not a node away; not retried) |",
    "| `connections_refused` | warning | kvpool.serve | `held_back`: over "
    "`server.max_connections`; rate-limited |",
    "| `fd_limit`, `accept_failed`, `accept_recovered` | info, warning | kvpool.serve | "
    "`soft`, `hard`; `errno`, `held_back`; `failures` |",
    "| `start_failed` | error | kvpool.serve | a setting to fix (exit 2) or an OS failure "
    "(exit 1): one line, in the log format (text: the bare `kvpool serve: ...` line) |",
    "| `no_uvloop` | warning | kvpool.serve | uvloop is not installed (the `[server]` extra): "
    "the node serves on asyncio's default loop |",
    "| `metrics_listening` | info | kvpool.metrics.http | `port` |",
    "| `events_listening` | debug | kvpool.events.publisher | `endpoint`, `replay_endpoint`, "
    "`node`, `incarnation`: KV events are published (docs/routing.md; a node's "
    "`GET /events` answers them too) |",
    "| `events_failed` | warning | kvpool.events.publisher | `held_back`: a send or a replay "
    "request failed (a sequence gap for consumers); rate-limited |",
    "| `events_unavailable` | warning | kvpool.events.attach | pyzmq or msgspec is missing "
    "(the `[server]` extra): no KV events |",
    "| `ssd_recovered` | info | kvpool.ssd | `records`, `segments`: the SSD log "
    "read at open |",
    "| `etcd_unreachable`, `etcd_reachable` | warning, info | kvpool.cluster.etcd_membership | "
    "`cluster`: a client's or node's membership watch lost / regained etcd |",
]


def _default_repr(value: object) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 20:
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20)):
            if value % size == 0:
                return f"{value // size}{unit}"
    if value is None:
        return "null"
    if value == "":
        return '""'
    return str(value).lower() if isinstance(value, bool) else str(value)


def settings_models() -> list[tuple[str, type[BaseModel]]]:
    """Every documented model with the key prefix its fields are shown under."""
    found: list[tuple[str, type[BaseModel]]] = [("", Config)]
    for name, field in Config.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            found.append((f"{name}.", field.annotation))
    return [*found, (f"{EXTRA_CONFIG}.", ConnectorSettings)]


def _rows(model: type[BaseModel], defaults: BaseModel | None, prefix: str = "") -> list[str]:
    """One table row per field; a nested section's fields under ``section.``. Defaults come
    from ``defaults`` where given (a model built with its defaults), else from the field; a
    field without one (its description says what it defaults to) shows as a dash."""
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{field.alias or name}"
        if defaults is None and field.is_required():
            rows.append(f"| `{key}` | - | {field.description} |")
            continue
        value = (getattr(defaults, name) if defaults is not None
                 else field.get_default(call_default_factory=True))
        if isinstance(value, BaseModel):
            rows.extend(_rows(type(value), value, f"{key}."))
        else:
            rows.append(f"| `{key}` | `{_default_repr(value)}` | {field.description} |")
    return rows


def config_markdown() -> str:
    """Markdown tables of every knob: kvpool's, then the vLLM connector's."""
    header = ["| key | default | meaning |", "| --- | --- | --- |"]
    lines = [
        "# kvpool configuration",
        "",
        "One YAML file (`--config FILE` where a command takes it, else `$KVPOOL_CONFIG`),",
        "then environment overrides `KVPOOL_<SECTION>__<KEY>` (e.g.",
        "`KVPOOL_DRAM__CAPACITY=8GiB`, `KVPOOL_CLUSTER__TLS__ENABLED=true`) and",
        "`KVPOOL_CACHE_DIR`. Any other `KVPOOL_*` variable (no `__` in its name, not a",
        "top-level key: `KVPOOL_BIN` of a wrapper script) is not kvpool's and is ignored. Sizes",
        "take B, KiB, MiB, GiB, TiB (binary) or KB, MB, GB, TB (decimal). Unknown keys (a",
        "misspelt `KVPOOL_DRAM__CAPACITYY` too) and bad values are refused with a message naming",
        "the key. `kvpool config` prints the effective settings, with every token",
        "(`server.auth[].token`, `server.admin_token`, `cluster.token`) shown as `***`;",
        "`kvpool config --doc` prints these tables.",
        "",
        *header,
        *_rows(Config, Config(cache_dir="~/.cache/kvpool")),
        "",
        f"## vLLM connector: `{EXTRA_CONFIG}`",
        "",
        "The connector ([vLLM with kvpool](vllm.md)) takes its settings from vLLM's",
        f"`{EXTRA_CONFIG}`, validated the same way: an unknown key or a bad value stops the",
        f"engine at start with a message naming the key (`{EXTRA_CONFIG}.chunk_tokens: ...`).",
        "Every key is optional.",
        "",
        *header,
        *_rows(ConnectorSettings, None),
        "",
        *YRCLOUDFILE_SECTION,
        "",
        *LOG_EVENTS_SECTION,
        "",
        "## Removed keys",
        "",
        "A file that still sets one of these is refused (unknown key).",
        "",
        "| key | why |",
        "| --- | --- |",
        *(f"| `{key}` | {why} |" for key, why in REMOVED_KEYS.items()),
    ]
    return "\n".join(lines) + "\n"
