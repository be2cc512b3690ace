"""One settings model for kvpool: YAML file + ``KVPOOL_*`` environment overrides.

Every knob is documented here with its default (``docs/config.md`` lists them too). Unknown
keys and bad values raise ConfigError with a message naming the key, e.g. ``dram.capacity``.

Environment overrides use a double underscore between section and key:
``KVPOOL_DRAM__CAPACITY=8GiB``, ``KVPOOL_SSD__DURABILITY=durable``, ``KVPOOL_CACHE_DIR=/x``.
Only those are settings: a ``KVPOOL_`` variable with ``__`` in its name (an unknown section
or key there is refused, naming it), or one named after a top-level key (``KVPOOL_CACHE_DIR``).
Any other ``KVPOOL_*`` variable (``KVPOOL_BIN`` of a wrapper script) is not kvpool's and is
ignored. ``KVPOOL_CONFIG`` names the YAML file to load when no path is given.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kvpool.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kb": 1000, "kib": 1024,
    "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1024**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1024**4, "tb": 1000**4, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object) -> int:
    """``"4GiB"`` -> 4294967296. Accepts ints and strings with B/KiB/MiB/GiB/TiB (binary) or
    KB/MB/GB/TB (decimal). Raises ValueError for anything else or a negative size."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative: {value}")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ValueError(f"not a size: {value!r} (use e.g. 4GiB, 512MiB, 65536)")


Size = Annotated[int, BeforeValidator(parse_size)]

#: Alignment of DRAM slabs and SSD segments (O_DIRECT and page size).
BLOCK_BYTES = 4096
#: Smallest SSD segment the engine accepts (a header block and room for records).
MIN_SEGMENT_BYTES = 4 * BLOCK_BYTES
#: Segment numbers are 16-bit in the SSD index.
MAX_SEGMENTS = 0xFFFF


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DramConfig(_Section):
    """Host DRAM arena: one mmap carved into page-aligned slots per chunk size class."""

    capacity: Size = Field(1 << 30, description="Arena size; a hard bound on DRAM use. 0 disables the DRAM tier.")
    slab_size: Size = Field(64 << 20, description="Unit the arena hands to a size class; must be >= the largest chunk.")
    eviction: Literal["auto", "arc", "adaptive", "lru", "s3fifo", "prefix"] = Field("auto", description="Eviction policy of each size class. auto: arc when no tier lies below DRAM (no SSD, no cluster), prefix when one does: replayed by kvpool plan on the Mooncake traces, arc is the best DRAM-only policy and prefix the best over an SSD written through (at DRAM 10% over an SSD of 25% of distinct chunks, synthetic trace: prefix 0.462, arc 0.429, lru 0.422; conversation_head 0.295 / 0.285 / 0.263) (docs/plan.md). arc: ARC (a recency list T1 and a frequency list T2 whose split follows two ghost lists of 3x the residents' keys) (policy/arc.py); replayed by kvpool plan on the Mooncake traces (DRAM only, 5/10/25/50% of distinct chunks, partial last blocks not stored) it hit 0.127/0.188/0.282/0.329 of chunk references on conversation_head (lru 0.084/0.171/0.280/0.335, prefix 0.119/0.183/0.275/0.326, adaptive 0.115/0.185/0.284/0.326; arc 0.55x Belady at 10%) and 0.165/0.268/0.467/0.615 on the synthetic trace (lru 0.153/0.251/0.449/0.601, prefix 0.153/0.262/0.451/0.618) (docs/plan.md). adaptive: prefix whose small-queue share (10-40%) follows its two ghost lists (policy/adaptive.py). prefix: S3-FIFO that evicts the chunks of each put_many / commit_many tail first (a chunk is useful only while its whole prefix is cached). s3fifo: plain S3-FIFO; lru: least recently used.")
    shm_path: str | None = Field(None, description="Back the arena by this /dev/shm file (shared with local engine processes) instead of anonymous memory.")
    prefault: Literal["none", "start", "background"] = Field("start", description="When the arena's pages are taken. start: all pages when the pool opens (MADV_POPULATE_WRITE, ~0.5 s per GiB here), so an engine pays them at start-up; none: on a chunk's first write (a put into never-touched memory pays a page fault and zero-fill per 4 KiB, ~7x slower than the copy itself); background: a nice +10 thread populates slab by slab from start, opening does not wait. Measured with the vLLM CPU engine on 2 cores (kvpool bench vllm, full runs): start gave hit p99/median 1.29 and first request 1.07x; none 1.75 and 11.2 (one 1.4 s hit right after a store) and 1.23x / 1.21x; background slowed the first request to 3.2 s (its kernel work shares the cores the forward's threads wait on). RSS grows to dram.capacity with start and background. true / false mean start / none.")

    @field_validator("prefault", mode="before")
    @classmethod
    def _prefault_bools(cls, value: object) -> object:
        return {True: "start", False: "none"}.get(value, value) if isinstance(value, bool) \
            else value
    put_wait_s: float = Field(1.0, ge=0, description="How long a put waits for a slot when every resident chunk is pinned by a zero-copy view, before the put is dropped (counted).")
    warm_cache_ratio: float | None = Field(None, gt=0, le=0.9, description="YRCloudFile's warm_cache_ratio: dram.capacity becomes this share of the host's memory (MemTotal, or the memory limit of the cgroup this process runs in where lower), rounded down to whole dram.slab_size; kvpool config prints the capacity it resolved to. Setting dram.capacity as well is refused (which one would win is not guessable). null: dram.capacity as given.")

    @model_validator(mode="before")
    @classmethod
    def _capacity_from_ratio(cls, data: Any) -> Any:
        if not isinstance(data, Mapping) or data.get("warm_cache_ratio") is None:
            return data
        if "capacity" in data:
            raise ValueError("dram.capacity and dram.warm_cache_ratio: set one, not both")
        try:
            ratio = float(data["warm_cache_ratio"])
            slab = parse_size(data.get("slab_size", cls.model_fields["slab_size"].default))
        except (TypeError, ValueError):
            return data  # the fields' own validation names the bad value
        if not 0 < ratio <= 0.9 or slab <= 0:
            return data
        from kvpool.hostmem import host_memory_total
        total = host_memory_total()
        capacity = int(total * ratio) // slab * slab
        if capacity <= 0:
            raise ValueError(f"dram.warm_cache_ratio={ratio}: {ratio:g} of the host's "
                             f"{total} bytes is less than one dram.slab_size={slab}")
        return {**data, "capacity": capacity}

    @field_validator("slab_size")
    @classmethod
    def _slab_aligned(cls, value: int) -> int:
        if value <= 0 or value % BLOCK_BYTES:
            raise ValueError(f"must be a positive multiple of {BLOCK_BYTES}")
        return value

    @model_validator(mode="after")
    def _holds_a_slab(self) -> DramConfig:
        if 0 < self.capacity < self.slab_size:
            raise ValueError(f"dram.capacity={self.capacity}: smaller than one "
                             f"dram.slab_size={self.slab_size} (0 disables the DRAM tier)")
        return self


class SsdConfig(_Section):
    """Local SSD tier: a log-structured engine of large segments written with O_DIRECT."""

    enabled: bool = Field(True, description="Use the SSD tier.")
    path: str | None = Field(None, description="Directory for segment files, or an existing block device / file used as one raw region. Default: <cache_dir>/ssd.")
    capacity: Size = Field(8 << 30, description="Bytes of SSD space used (rounded down to whole segments, at least 2).")
    segment_size: Size = Field(256 << 20, description="Segment size; eviction frees one whole segment at a time.")
    durability: Literal["cache", "durable"] = Field("cache", description="cache: no fsync, a crash may lose recent records (never corrupts); durable: every SSD write is fdatasync-ed before it counts, and with pool.ssd_write: through (or no DRAM tier) KVPool.put returns True only once its record is synced (a batch shares one sync); with ssd_write: evict only chunks already demoted to SSD survive a crash.")
    io_threads: int = Field(4, ge=1, le=64, description="Threads running SSD reads/writes for batched calls.")
    direct_io: Literal["auto", "on", "off"] = Field("auto", description="O_DIRECT: auto falls back to buffered IO with one warning where the file system refuses it; on fails instead.")
    eviction: Literal["fifo", "second_chance"] = Field("second_chance", description="Oldest segment goes first; second_chance copies records read since written forward.")
    copy_forward_fraction: float = Field(0.25, ge=0, le=0.9, description="At most this fraction of a segment is copied forward per eviction.")
    admission: Literal["always", "second_use", "hit", "frequency"] = Field("always", description="With pool.ssd_write: evict, which DRAM victims are written to SSD. always: all; second_use: chunks read while in DRAM or offered before (within ssd.second_use_window keys); frequency: the same with a fixed-size count-min sketch instead of the key window; hit: only chunks read while in DRAM. On the Mooncake conversation head (DRAM 10%, SSD 100%, kvpool plan --ssd-write evict) with dram.eviction auto (prefix over an SSD) always hits 0.343 of chunks writing 4.00 SSD bytes per byte later hit from the SSD, second_use 0.208 writing 4.48, frequency 0.208 writing 4.71, hit 0.183 (no SSD hit) (with lru: 0.343 / 3.57, 0.249 / 1.91, 0.249 / 1.94, 0.212 / 1.84; docs/plan.md): the default DRAM policy already keeps what is read, so its victims are the chunks a filter would refuse and a filter loses a third of the hits without saving wear per hit; hence always.")
    second_use_window: int = Field(65536, ge=1, description="Keys remembered by the second_use admission policy.")
    read_pipeline_min_bytes: Size = Field(1 << 20, description="A single chunk read (not a batch) at least this large is read in pieces, so its checksum overlaps the IO; batched reads overlap one another instead and are never split.")
    read_piece_bytes: Size = Field(512 << 10, description=f"Piece size of a split read (a positive multiple of {BLOCK_BYTES}, for O_DIRECT); a coalesced run (ssd.coalesce_max_bytes) of at least twice this size is read in pieces of whole records of about this size, each checked as it lands.")
    read_pipeline_threads: int = Field(2, ge=1, le=64, description="Threads reading the pieces of split reads and coalesced runs.")
    coalesce_max_bytes: Size = Field(8 << 20, ge=0, description="A get_many_into reads keys whose records lie back to back in one segment, in the order asked (a prefix saved by one put_many), with one preadv per run of at most this many bytes (headers included); every record is still checked alone. 0: one read per record.")
    tail_verify_bytes: Size = Field(64 << 20, description="On open, the records in this many bytes at the end of the newest segment have their payload re-read and checked, and a trailing run of bad ones (a torn write) is cut; larger opens slower. A bad record left in the log (0: none checked) is a counted miss when read, never served.")

    @field_validator("read_piece_bytes")
    @classmethod
    def _piece_aligned(cls, value: int) -> int:
        if value <= 0 or value % BLOCK_BYTES:
            raise ValueError(f"must be a positive multiple of {BLOCK_BYTES}")
        return value

    @field_validator("segment_size")
    @classmethod
    def _segment_aligned(cls, value: int) -> int:
        if value % BLOCK_BYTES or value < MIN_SEGMENT_BYTES:
            raise ValueError(f"must be a multiple of {BLOCK_BYTES} and at least "
                             f"{MIN_SEGMENT_BYTES}")
        return value

    @model_validator(mode="after")
    def _segment_count(self) -> SsdConfig:
        if not self.enabled:
            return self
        segments = self.capacity // self.segment_size
        if segments < 2:
            raise ValueError(f"ssd.capacity={self.capacity}: holds fewer than 2 segments of "
                             f"ssd.segment_size={self.segment_size} (needs at least "
                             f"{2 * self.segment_size}, or ssd.enabled: false)")
        if segments > MAX_SEGMENTS:
            raise ValueError(f"ssd.capacity={self.capacity}: more than {MAX_SEGMENTS} segments "
                             f"of ssd.segment_size={self.segment_size}; raise ssd.segment_size")
        return self


class TenantQuota(_Section):
    """Bytes one tenant may hold (docs/retention.md); unset: unbounded."""

    dram_bytes: Size | None = Field(None, ge=0, description="DRAM bytes (slot sizes) the tenant's chunks may hold; at it, the tenant's saves evict its own chunks (by the eviction policy and retention), never another tenant's, and a save none of its own can make room for is dropped (counted as quota_drops).")
    ssd_bytes: Size | None = Field(None, ge=0, description="SSD bytes the tenant's chunks may hold, as written by this pool; at it, the tenant's oldest SSD chunks are deleted for the new one (counted as ssd_quota_evictions).")


class PoolConfig(_Section):
    """The embedded pool that composes the tiers."""

    ssd_write: Literal["evict", "through"] = Field("through", description="through: every put is also written to SSD, so a restart keeps it: through the write-behind queue in cache mode (a kill -9 may lose what is still queued, typically milliseconds of saves), synchronously with ssd.durability: durable. evict: only DRAM victims (as ssd.admission allows) are demoted to SSD, and close writes what only DRAM holds (pool.close_drain_s); a kill loses every DRAM-only chunk.")
    background_nice: int = Field(10, ge=0, le=19, description="Nice value added to the pool's background threads (the SSD and cluster write-behind queues, the mover's prefetches and promotions; Linux, per thread), so an engine's own threads get the cores first; such a thread still gets its share of a core, so its work completes, later under full load (a queue that fills meanwhile drops saves, counted). 0: equal priority.")
    close_drain_s: float = Field(10.0, ge=0, description="How long close may spend writing the DRAM chunks the SSD lacks to it (oldest first): with ssd_write: evict every chunk only DRAM holds; in either mode a chunk whose SSD record was evicted while DRAM served it, or whose write-through save was dropped. What is left is lost, with a warning. 0: write nothing.")
    write_behind_bytes: Size = Field(256 << 20, description="Staging memory for chunks on their way to SSD; when full, further saves to SSD are dropped (counted), never waited for.")
    write_behind_batch: int = Field(16, ge=1, description="Chunks written to SSD per batch by the write-behind worker.")
    write_behind_threads: int = Field(2, ge=1, le=16, description="Worker threads of the SSD's write-behind queue, each writing a batch at a time: with two, one hashes its batch (and waits for a core) while the other's is being written, so the disk is not idle between batches; batches still reach the log in the order they were queued. 1: one worker (the disk idles while it hashes).")
    save_budget_bytes: Size = Field(256 << 20, description="Bytes of chunks saved through KVPool.save / begin_save (what every engine integration saves with) that are reserved, being filled or waiting for their commit; a save that would exceed it drops its tail (a save is a prefix), counted as save_dropped_budget, never waited for. The one bound on an engine's save backlog (the SSD's own queue is pool.write_behind_bytes).")
    save_commit_wait_s: float = Field(2.0, gt=0, description="Read-your-writes: a read (KVPool.load, get_many_into, pin_many) of a chunk whose save is still waiting for its commit waits this long at most, then reads what is there (a miss if the commit has not landed; counted as load_commit_timeouts).")
    promote_on_hit: bool = Field(True, description="Copy an SSD hit up into DRAM.")
    prefetch_max_pending: int = Field(4, ge=1, description="Background moves up into DRAM (KVPool.prefetch, and promotions of chunks a read found only on SSD or the nodes) queued at once; more are skipped (counted as prefetch_skipped / promotions_skipped), never waited for.")
    prefetch_batch: int = Field(8, ge=1, description="Chunks a background move reads per batch, straight into reserved DRAM slots.")
    warm_start_fraction: float = Field(0.5, ge=0, le=1, description="When a namespace is registered (an engine or a storage node starting over an existing cache_dir), the newest SSD chunks of it are read up into DRAM in the background (the mover, at pool.background_nice), up to this share of dram.capacity and never more than DRAM has free at that moment (a namespace registered while others fill DRAM does not evict their chunks), so the first hits after a restart are DRAM hits: the newest writes stand in for the hot set, whose recency a restart lost. Counted as warmed (warm_skipped: the mover was busy); chunks already in DRAM are skipped. 0: off.")
    max_pinned_fraction: float = Field(0.5, ge=0, le=1, description="Bound on the bytes saves may pin (retention priority pin), as a share of dram.capacity (on a storage node: of its own). A save whose pins would pass it raises PinLimitError (a node answers PIN_LIMIT); nothing of it is pinned. 0: no pins.")
    tenant_quotas: dict[str, TenantQuota] = Field(default_factory=dict, description="Per tenant (the tenant_salt before its first ':'): bytes of DRAM and SSD its chunks may hold, e.g. {acme: {dram_bytes: 4GiB, ssd_bytes: 100GiB}}. Enforced by every pool, storage nodes included (docs/retention.md).")
    prefetch_window_chunks: int = Field(16, ge=0, description="Read-ahead along a prefix (YRCloudFile's prefetch_window, in chunks): an integration passes it to KVPool.lookup(prefetch=...), which moves the first this-many chunks of the prefix found that DRAM lacks up into DRAM in the background, so the load that follows finds them there; the integrations turn it into tokens (chunks x chunk tokens). 0 = off. Default from kvpool bench storage (prefetch case, 64 KiB chunks, CPU box): a 16-chunk SSD-only prefix loaded 2 ms after its lookup took ~0.2 ms instead of ~1.8 ms; a load issued right after the lookup was 25-50% slower instead (the move and the load read the same chunks), so an integration whose load cannot follow its lookup by a scheduler step should pass 0.")


class TenantToken(_Section):
    """One access token and the tenants it may act for."""

    token: str = Field(min_length=8, description="Secret the client sends in AUTH (at least 8 characters).")
    tenants: list[str] = Field(min_length=1, description="Tenants this token may use. A namespace belongs to the tenant named before the first ':' of its tenant_salt.")


class ServerTlsConfig(_Section):
    """TLS on a storage node's client port (Python's ``ssl``). Off while ``cert_file`` is
    unset; then every connection is plain TCP."""

    cert_file: str | None = Field(None, description="PEM certificate chain the node presents (its names or IP addresses must match what clients dial, or cluster.tls.server_name). Set: the node speaks TLS only; a plain client's first request is answered BAD_REQUEST naming this key, and the connection closed.")
    key_file: str | None = Field(None, description="PEM private key of cert_file (required with it). A file that cannot be read or does not match stops kvpool serve (exit 2) naming the key.")
    client_ca_file: str | None = Field(None, description="Mutual TLS: a client must present a certificate signed by a CA in this PEM file, else its handshake fails and the connection is closed (counted as tls_handshake_failures in STATS). Unset: clients are not asked for a certificate (use server.auth tokens).")

    @model_validator(mode="after")
    def _pairs(self) -> ServerTlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("server.tls.cert_file and server.tls.key_file: set both or neither")
        if self.client_ca_file is not None and self.cert_file is None:
            raise ValueError("server.tls.client_ca_file: needs server.tls.cert_file and "
                             "server.tls.key_file")
        return self

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None


#: server.* keys that no longer mean anything (ServerConfig._retired_transport_keys).
RETIRED_SERVER_KEYS = frozenset({"offload_bytes", "worker_threads", "net_threads",
                                 "lane_connections", "inline_exists_keys"})


class ServerConfig(_Section):
    """A storage node (`kvpool serve`): DRAM + SSD behind the binary protocol."""

    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(7450, ge=0, le=65535, description="TCP port (0 = any free port, printed at start).")
    node_id: str | None = Field(None, description="Name registered in etcd; default host:port.")
    advertise_host: str | None = Field(None, description="Host clients should dial (default: host).")
    auth: list[TenantToken] = Field(default_factory=list, description="Per-tenant tokens. Empty: no auth (trusted networks only); otherwise every connection must AUTH first.")
    admin_token: str | None = Field(None, min_length=8, description="Token whose AUTH sees node-wide STATS and may invalidate any namespace by id (kvpool admin), and reads no tenant's data; tenant tokens see only their own tenants' figures. Needs server.auth; without auth every connection sees node-wide STATS.")
    auth_timeout_s: float = Field(5.0, gt=0, description="With auth on: a connection that has not completed AUTH this long after it was accepted is closed, whatever it sends meanwhile. Also bounds how long a connection refused over max_connections waits for its first request (to answer it BUSY).")
    max_frame_bytes: Size = Field(256 << 20, description="Largest request (metadata + payload); a larger one closes the connection.")
    max_item_bytes: Size = Field(64 << 20, description="Largest chunk a namespace may declare.")
    max_keys: int = Field(65536, ge=1, description="Most keys in one request.")
    max_inflight_bytes: Size = Field(512 << 20, description="Per connection: payload bytes a GET may answer with at once; larger batches are refused (TOO_LARGE).")
    max_connections: int = Field(1024, ge=1, description="Connections served at once; a connection over the limit gets BUSY to its first request and is closed (counted, logged rate-limited). The soft fd limit is raised to the hard one at start.")
    max_namespaces: int = Field(4096, ge=1, description="Namespaces the node keeps registered; past it, the least recently used one that no connection has declared is forgotten (its chunks stay stored and serve again once declared). A NAMESPACE that would need more, all in use, is refused BUSY.")
    idle_timeout_s: float = Field(300.0, gt=0, description="A connection silent this long (or stalled mid-frame) is closed.")
    shutdown_timeout_s: float = Field(30.0, ge=0, description="On SIGTERM or SIGINT: the whole graceful stop (refuse new PUTs, let in-flight requests finish (at most half of it), deregister from etcd, flush the write-behind queue to SSD) takes at most this long; then the node exits 0. The old name drain_timeout_s is still accepted.")
    max_namespaces_per_connection: int = Field(256, ge=1, description="Namespaces one connection may declare (bounds per-connection memory); a NAMESPACE past it is refused BAD_REQUEST.")
    max_refusing: int = Field(32, ge=0, description="Connections over max_connections held open at once until their first request is answered BUSY; more are closed without an answer.")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="Serve Prometheus metrics at http://<host>:<metrics_port>/metrics (the node's pool, its tiers and its server; 0 = any free port). Registered in etcd beside the node's address, so kvpool monitor finds it. Unset: none.")
    tls: ServerTlsConfig = Field(default_factory=lambda: ServerTlsConfig(), description="TLS for client connections.")
    max_held_bytes: Size = Field(0, ge=0, description="Node-wide: bytes held at once for requests in progress: GET answers read from below DRAM into per-request buffers (until sent) and PUT payloads being received into reserved slots (until committed). A GET that would take it past this is answered BUSY (clients count a miss); a PUT keeps the chunks that fit and drops the rest as for lack of room, and is answered BUSY when none fits (a dropped save). A key no tier holds costs no payload memory. 0 = derived: a quarter of dram.capacity, at least 256 MiB.")
    tenant_held_share: float = Field(0.5, gt=0, le=1, description="With server.auth: the share of max_held_bytes one tenant (all its connections) may hold at once, and of the DRAM tier its PUTs in progress may hold reserved; past it, as past max_held_bytes. So one tenant's unread answers or stalled PUTs cannot starve the others. Without auth a tenant is any salt a client picks: only max_held_bytes applies.")
    payload_stall_timeout_s: float = Field(5.0, gt=0, description="A PUT whose payload stops arriving (no chunk completes) for this long is closed (counted payload_stalls in STATS) and its reserved slots released; idle_timeout_s still bounds a peer silent between requests.")

    @model_validator(mode="before")
    @classmethod
    def _old_shutdown_name(cls, data: Any) -> Any:
        """``drain_timeout_s`` was renamed ``shutdown_timeout_s`` (``kvpool admin drain`` is
        another thing): the old name is accepted, both at once are refused."""
        if isinstance(data, dict) and "drain_timeout_s" in data:
            data = dict(data)
            if "shutdown_timeout_s" in data:
                raise ValueError("server.drain_timeout_s: the old name of "
                                 "server.shutdown_timeout_s; set only one of them")
            data["shutdown_timeout_s"] = data.pop("drain_timeout_s")
        return data

    @model_validator(mode="before")
    @classmethod
    def _retired_transport_keys(cls, data: Any) -> Any:
        """Keys of the node's former mixed transport (event loop, network threads, lanes),
        which a thread per connection made meaningless: accepted and ignored, so configs
        written for it still load."""
        if isinstance(data, dict) and RETIRED_SERVER_KEYS & data.keys():
            data = {k: v for k, v in data.items() if k not in RETIRED_SERVER_KEYS}
        return data

    @model_validator(mode="after")
    def _admin_needs_auth(self) -> ServerConfig:
        if self.admin_token is None:
            return self
        if not self.auth:
            raise ValueError("server.admin_token: needs server.auth tokens (without auth "
                             "every connection already sees node-wide STATS)")
        if any(t.token == self.admin_token for t in self.auth):
            raise ValueError("server.admin_token: must differ from every server.auth token")
        return self


class ClusterTlsConfig(_Section):
    """TLS from a client (an engine's pool, kvpool admin, the bench) to the storage nodes."""

    enabled: bool = Field(False, description="Connect to every node with TLS and verify its certificate; a node whose certificate does not verify (or a plain node) is marked down and its requests are misses, never retried in plain text. false: plain TCP (the other keys must then be unset).")
    ca_file: str | None = Field(None, description="PEM file of the CAs that sign the nodes' certificates. Unset: the system's default CAs.")
    cert_file: str | None = Field(None, description="PEM client certificate, for nodes that require one (server.tls.client_ca_file).")
    key_file: str | None = Field(None, description="PEM private key of cert_file (required with it).")
    server_name: str | None = Field(None, description="Name every node's certificate must carry instead of the host the client dials (one certificate shared by all nodes). Unset: the dialled host or IP address.")
    check_hostname: bool = Field(True, description="Check the certificate's name (server_name or the dialled host). false: any certificate the CAs signed is accepted (the chain is always verified).")

    @model_validator(mode="after")
    def _consistent(self) -> ClusterTlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cluster.tls.cert_file and cluster.tls.key_file: set both or "
                             "neither")
        if not self.enabled:
            for key in ("ca_file", "cert_file", "server_name"):
                if getattr(self, key) is not None:
                    raise ValueError(f"cluster.tls.{key}: set cluster.tls.enabled: true too "
                                     "(without it the client connects in plain text)")
        return self


class ClusterConfig(_Section):
    """How clients (and nodes, for registration) find the storage nodes."""

    name: str = Field("default", description="Cluster name: nodes register under /kvpool/<name>/nodes/.")
    nodes: list[str] = Field(default_factory=list, description="Static node list (host:port); used when etcd is empty. Both empty: embedded only.")
    etcd: list[str] = Field(default_factory=list, description="etcd endpoints (http://host:port) for membership.")
    lease_ttl_s: float = Field(10.0, ge=1, description="Node registration lease: a dead node leaves placement within this time.")
    membership_grace_s: float | None = Field(None, ge=0, description="A node whose etcd key vanished without a clean stop (lease expired: it died, or etcd was paused or cut off longer than the TTL) stays in a client's placement this long unless it registers again; requests that fail still mark it down at once. Unset: 2 x lease_ttl_s. 0: drop it at once.")
    token: str | None = Field(None, description="Client token sent in AUTH when nodes require it.")
    replicas: int = Field(1, ge=1, le=8, description="Default replication factor (copies written per chunk).")
    namespace_replicas: dict[str, int] = Field(default_factory=dict, description="Replication per model name, overriding replicas.")
    connections_per_node: int = Field(4, ge=1, le=64, description="Pooled connections the client keeps per node.")
    connect_timeout_s: float = Field(0.5, gt=0, description="TCP connect timeout; a node that does not answer is marked down.")
    request_timeout_s: float = Field(5.0, gt=0, description="Per-request socket timeout; on expiry the node is marked down and the request becomes a miss.")
    retry_down_s: float = Field(2.0, gt=0, description="A node marked down is tried again after this long.")
    write_behind_bytes: Size = Field(256 << 20, description="Staging memory for saves on their way to the nodes; full = dropped (counted).")
    fanout_threads: int = Field(8, ge=1, le=128, description="Threads the client uses to talk to nodes in parallel.")
    batch_bytes: Size = Field(64 << 20, gt=0, description="Largest payload one GET or PUT request carries; bigger batches are split. Keep it under the nodes' server.max_frame_bytes and server.max_inflight_bytes.")
    socket_buffer_bytes: Size = Field(4 << 20, gt=0, description="SO_SNDBUF / SO_RCVBUF of each client connection (the kernel may cap it: net.core.wmem_max, rmem_max): big enough for a multi-MiB chunk to go out in one sendmsg.")
    live_cache_s: float = Field(0.05, ge=0, description="How long a computed list of live nodes is reused: membership changes are seen this late (a node marked down is dropped at once).")
    touch_threads: int = Field(2, ge=1, le=64, description="Threads sending TOUCHes to the replicas a read did not fetch from (off the read path).")
    touch_max_keys: int = Field(65536, ge=1, description="Touch keys queued per node; beyond it touches are dropped (counted as touch_dropped).")
    touch_batch_keys: int = Field(4096, ge=1, description="Keys per TOUCH request; keep it under the nodes' server.max_keys.")
    read_repair_bytes: Size = Field(64 << 20, description="Client read repair: bytes of chunks queued to be written back to a replica a read found without them (sent by a background thread); full = the repair is dropped (counted as read_repair_dropped). 0 turns read repair off.")
    repair_max_age_s: float = Field(120.0, gt=0, description="A read repair or hinted write (a replica that missed a PUT because it failed or was marked down, written once it answers again) not sent within this long is dropped (counted as read_repair_failures), so a node gone for good does not hold the queue.")
    repair_bytes_per_s: Size = Field(64 << 20, description="Node re-replication and drain copying (docs/cluster.md): chunk bytes per second a node sends to its peers (token bucket). 0 turns node-side repair off.")
    repair_delay_s: float = Field(3.0, ge=0, description="A node starts re-replicating this long after the last membership change it saw (joins, leaves, drains): a burst of changes costs one pass.")
    tls: ClusterTlsConfig = Field(default_factory=lambda: ClusterTlsConfig(), description="TLS to the storage nodes.")

    @property
    def enabled(self) -> bool:
        return bool(self.nodes or self.etcd)

    @property
    def grace_s(self) -> float:
        """membership_grace_s, or 2 x lease_ttl_s when unset."""
        return 2 * self.lease_ttl_s if self.membership_grace_s is None else self.membership_grace_s


class MetricsConfig(_Section):
    """Prometheus metrics of an embedded pool or an engine's (a storage node serves its own
    on server.metrics_port). docs/operations.md lists the metrics."""

    enabled: bool = Field(True, description="Record latency histograms of pool calls (about 1 us per call); counters come from the tiers' own counts at scrape time and cost nothing. false: no histograms; the counters are still exported if a port is set.")
    port: int | None = Field(None, ge=0, le=65535, description="Serve http://<host>:<port>/metrics from this process (0 = any free port). Unset: no HTTP server (the registry is still reachable as KVPool.metrics). A vLLM worker of tensor-parallel rank r serves port + r.")
    host: str = Field("127.0.0.1", description="Address the metrics HTTP server listens on.")


class LogConfig(_Section):
    """Logging of the kvpool commands (`kvpool serve`, `kvpool demo`); an embedded pool leaves
    its host process's logging alone unless ``configure`` is set."""

    level: Literal["debug", "info", "warning", "error"] = Field("info", description="Lowest level logged (every logger; kvpool's log under kvpool.*).")
    format: Literal["text", "json"] = Field("text", description="text: `time LEVEL logger: message`; json: one JSON object per line with ts (UTC, ISO 8601), level, logger, event (one of the events in docs/config.md; for any other line its logger's name under kvpool.), message and the event's own fields (node, segment, offset, peer, count, ...).")
    configure: bool = Field(False, description="An embedded KVPool applies level and format to the process's logging when it opens (replacing only the handler kvpool installed). Off by default: a host process (vLLM, an application) owns its logging; the kvpool commands always apply them.")


class EventsConfig(_Section):
    """KV events: what enters and leaves the tiers, published in vLLM's KV event format (msgpack
    over ZMQ PUB, a replay socket; docs/routing.md)."""

    enabled: bool | None = Field(None, description="Publish KV events. Unset: on for kvpool serve (a storage node) and kvpool host (a host pool: one publisher for every tenant's pool, each event naming its tenant when server.auth lists several), off for an embedded pool; true turns them on for an embedded pool too, false off everywhere. Needs pyzmq and msgspec (kvpool[server]); without them the node logs one warning and publishes nothing.")
    host: str | None = Field(None, description="Address the PUB and replay sockets bind. Unset: server.host on a node and a host pool, metrics.host in an embedded pool. Where it is a wildcard (0.0.0.0, ::), GET /events names server.advertise_host in the endpoints instead (a consumer cannot dial 0.0.0.0).")
    port: int = Field(0, ge=0, le=65535, description="PUB socket port (0 = any free port; GET /events on a node's or host pool's metrics port answers the endpoints).")
    replay_port: int = Field(0, ge=0, le=65535, description="Replay (ZMQ ROUTER) socket port: a consumer that missed batches asks for them from a sequence number (0 = any free port).")
    topic: str = Field("kvpool", description="Topic frame of every event message.")
    node_id: str | None = Field(None, description="Who holds the chunks, in every batch (and a host pool's query answers). Unset: server.node_id on a node, the host name in a host pool and an embedded pool.")
    queue_events: int = Field(65536, ge=1, description="Events queued for the publisher thread; past it an event is dropped (counted as kvpool_events_dropped_total) and consumers see a sequence gap. Never blocks a put or an eviction.")
    replay_batches: int = Field(10000, ge=1, description="Batches kept for replay.")
    batch_interval_s: float = Field(0.05, gt=0, le=10, description="How often the publisher thread sends what was queued, as one batch.")


class QueryConfig(_Section):
    """The query API on a node's (and a host pool's) metrics port: /query, /query_by_hash
    (docs/routing.md)."""

    timeout_s: float = Field(2.0, gt=0, description="A cluster-wide query (scope: cluster) waits this long for each node; a node that does not answer in time is reported dead.")


class HostConfig(_Section):
    """One pool per host (docs/architecture.md, "The host pool"): ``kvpool host`` owns the
    DRAM arena (a shared-memory file per tenant) and the SSD; an engine whose config sets
    ``host.socket`` attaches to it (``kvpool.open_pool``) instead of opening its own tiers."""

    socket: str | None = Field(None, description="Unix socket of the host pool. kvpool host listens on it; an engine's pool (kvpool.open_pool) with it set attaches to the host pool there: the DRAM arena is mapped into the engine, lookups, pins and reservations go over the socket, and the engine's own dram, ssd and cluster sections are not used. Unset: the embedded pool.")
    tenant: str = Field("default", description="Tenant an engine attaches as; with server.auth on the host pool, host.token (or cluster.token) must list it. Its namespaces must belong to it (tenant_salt before the first ':'; without auth any).")
    token: str | None = Field(None, description="Token an engine sends when it attaches (checked against the host pool's server.auth). Unset: cluster.token.")
    shm_dir: str = Field("/dev/shm", description="Where kvpool host creates each tenant's arena file (mode 0600, unlinked once opened: engines receive it only as a file descriptor over the socket).")
    allowed_uids: list[int] = Field(default_factory=list, description="Besides the host pool's own uid and root, the uids (SO_PEERCRED) allowed to attach. Others are refused before any token is read.")
    connect_timeout_s: float = Field(1.0, gt=0, description="How long an engine waits to connect and attach; a host pool that is not there costs misses until it is.")
    request_timeout_s: float = Field(5.0, gt=0, description="How long an engine waits for one answer from the host pool; past it the engine detaches (its pins and reservations die with the connection) and its calls are misses or dropped saves until it attaches again.")
    retry_s: float = Field(1.0, gt=0, description="A detached engine tries to attach again at most this often (on its next call).")
    unpin_delay_s: float = Field(0.002, gt=0, le=1, description="An engine tells the host pool which pins it released with its next request, or within twice this long after the release if no request comes first: one wake-up of the host pool per read instead of two (measured here, 64 x 64 KiB reads on 2 loaded cores: the separate unpin write cost more than the copy). The slots stay pinned (not evictable) that much longer.")
    max_held: int = Field(65536, ge=1, description="Pins and reservations one attached connection may hold at once; past it a pin is a miss and a reservation a dropped save.")
    max_frame_bytes: Size = Field(256 << 20, description="Largest message on the socket (the byte fallbacks of reads and writes that find no DRAM slot carry payloads).")
    max_connections: int = Field(1024, ge=1, description="kvpool host: connections served at once (attached or attaching, every tenant). One past it is answered ok: false (busy) and closed, so a flood of connections costs the flooder, not the attached engines; such an engine detaches and retries (host.retry_s).")
    max_receive_bytes: Size = Field(1 << 30, gt=0, description="kvpool host: bytes of large messages (over 64 KiB: the byte fallbacks' payloads) being received and handled at once, over every connection. A message that would pass it closes its connection (that engine's save is dropped, and it re-attaches), so peers that declare big payloads and stall cannot take the host pool's memory; such a message must also arrive within host.request_timeout_s of its header.")
    populate: bool = Field(True, description="An engine faults its mapping of the arena in when it attaches (MAP_POPULATE), so its first reads pay no page faults.")
    direct_reads: bool = Field(True, description="kvpool host keeps a read directory per tenant (where each DRAM chunk lies, in shared memory, mapped read-only by engines), and an engine reads DRAM hits through it without a round trip to the host pool: a seqlock per entry, checked after the copy, instead of a pin (docs/architecture.md). x86-64 only (it relies on that CPU's memory ordering); off on either side: every read asks the host pool.")
    directory_entries: int = Field(0, ge=0, description="kvpool host: entries of each tenant's read directory (64 bytes each, a power of two). 0: two per 32 KiB of dram.capacity, between 4,096 and 2**24. A chunk whose bucket of 8 is full is read through the host pool (counted in the dram stats as directory_full).")

    @field_validator("directory_entries")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value and (value < 64 or value & (value - 1)):
            raise ValueError(f"must be 0 or a power of two >= 64, got {value}")
        return value
    cuda_register: Literal["auto", "off"] = Field("auto", description="auto: when torch is already imported in the engine and sees a CUDA device, the mapped arena is registered as pinned host memory (cudaHostRegister through torch), so device copies from and to it run at pinned speed; off: never.")


class Config(_Section):
    """Top-level kvpool settings."""

    cache_dir: str = Field(default_factory=lambda: str(_default_cache_dir()), description="Where embedded tiers keep their files.")
    dram: DramConfig = Field(default_factory=lambda: DramConfig())
    ssd: SsdConfig = Field(default_factory=lambda: SsdConfig())
    pool: PoolConfig = Field(default_factory=lambda: PoolConfig())
    cluster: ClusterConfig = Field(default_factory=lambda: ClusterConfig())
    server: ServerConfig = Field(default_factory=lambda: ServerConfig())
    metrics: MetricsConfig = Field(default_factory=lambda: MetricsConfig())
    log: LogConfig = Field(default_factory=lambda: LogConfig())
    events: EventsConfig = Field(default_factory=lambda: EventsConfig())
    query: QueryConfig = Field(default_factory=lambda: QueryConfig())
    host: HostConfig = Field(default_factory=lambda: HostConfig())

    def ssd_path(self) -> Path:
        return Path(self.ssd.path).expanduser() if self.ssd.path else Path(self.cache_dir).expanduser() / "ssd"


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvpool"


ENV_PREFIX = "KVPOOL_"
ENV_DELIMITER = "__"
_ENV_NOT_SETTINGS = {"KVPOOL_CONFIG"}


def is_setting_variable(name: str) -> bool:
    """Whether environment variable ``name`` is a settings override: ``KVPOOL_`` then
    ``<SECTION>__<KEY>`` (validated: a typo is refused), or a top-level key that is not a
    section (``KVPOOL_CACHE_DIR``). Other ``KVPOOL_*`` names belong to other tools."""
    if not name.startswith(ENV_PREFIX) or name in _ENV_NOT_SETTINGS:
        return False
    rest = name[len(ENV_PREFIX):]
    if ENV_DELIMITER in rest:
        return True
    field = Config.model_fields.get(rest.lower())
    return field is not None and not (isinstance(field.annotation, type)
                                      and issubclass(field.annotation, BaseModel))


def _env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in environ.items():
        if not is_setting_variable(name):
            continue
        path = name[len(ENV_PREFIX):].lower().split(ENV_DELIMITER)
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{name}: conflicts with another KVPOOL_ variable")
        # YAML parsing turns "true"/"4"/"0.5" into the right scalar; sizes stay strings.
        node[path[-1]] = yaml.safe_load(value) if value.strip() else value
    return out


#: Settings whose values are secrets: ``kvpool config`` prints them as REDACTED.
SECRET_KEYS = ("server.auth[].token", "server.admin_token", "cluster.token", "host.token")
REDACTED = "***"


def redact_secrets(data: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``Config.model_dump()`` output with every token (SECRET_KEYS) that is set
    replaced by REDACTED; file paths (TLS keys included) are kept."""
    out = {**data}
    server = out["server"] = {**data["server"]}
    server["auth"] = [{**t, "token": REDACTED} for t in data["server"]["auth"]]
    if server.get("admin_token") is not None:
        server["admin_token"] = REDACTED
    cluster = out["cluster"] = {**data["cluster"]}
    if cluster.get("token") is not None:
        cluster["token"] = REDACTED
    if data.get("host", {}).get("token") is not None:
        out["host"] = {**data["host"], "token": REDACTED}
    return out


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(merged.get(k), Mapping):
            merged[k] = _merge(dict(merged[k]), v)
        else:
            merged[k] = v
    return merged


def describe_errors(err: ValidationError, prefix: str = "") -> str:
    """Every error of a settings model, ``key: message (got value)``, joined by ``; ``. Keys
    are dotted paths (``dram.capacity``), under ``prefix`` if given; an unknown key reads
    ``key: unknown key``; a rule across keys that names its keys itself is kept as it is."""
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in (prefix, *e["loc"]) if p != "") or "<root>"
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        msg = msg.removeprefix("Value error, ")
        if e["type"] == "value_error" and msg.startswith(f"{key}."):
            # A rule across keys (a section's own validator) names its keys itself.
            lines.append(msg)
            continue
        shown = "" if e["type"] == "extra_forbidden" else f" (got {e.get('input')!r})"
        lines.append(f"{key}: {msg}{shown}")
    return "; ".join(lines)


def config_from_dict(data: Mapping[str, Any], source: str = "dict") -> Config:
    """Validate a mapping. Raises ConfigError naming each bad or unknown key."""
    try:
        return Config.model_validate(dict(data))
    except ValidationError as err:
        raise ConfigError(f"invalid kvpool config ({source}): {describe_errors(err)}") from None


def load_config(path: str | os.PathLike[str] | None = None,
                environ: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> Config:
    """Load YAML (``path`` or ``$KVPOOL_CONFIG``; defaults if neither), then apply ``KVPOOL_*``
    environment overrides, then ``overrides``.

    Raises ConfigError for a missing or malformed file, unknown keys or bad values.
    """
    env = os.environ if environ is None else environ
    path = path or env.get("KVPOOL_CONFIG")
    data: dict[str, Any] = {}
    source = "defaults"
    if path:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read kvpool config {path}: {exc.strerror}") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"kvpool config {path} is not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"kvpool config {path} must be a mapping at the top level")
        data = loaded or {}
    env_over = _env_overrides(env)
    if env_over:
        source += " + KVPOOL_* environment"
    data = _merge(data, env_over)
    if overrides:
        data = _merge(data, overrides)
    return config_from_dict(data, source)
