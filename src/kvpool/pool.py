"""KVPool: the embedded pool that composes an ordered list of tiers behind one API (DESIGN.md
sections 4-5; which tiers, in which order, is decided in tiers/stack.py).

Reads ask each tier in order (DRAM, write-behind staging, SSD, storage nodes) for what the
faster ones lacked; a chunk found below DRAM is promoted into DRAM in the background (mover.py),
never on the read's own path. Puts land in DRAM and in the stack's write-through tiers; DRAM
victims are demoted to SSD by the bounded write-behind queue, as the admission policy allows.

Durability: with ``ssd.durability: durable`` and ``pool.ssd_write: through`` (or no DRAM tier)
a put is acknowledged (True) only once its record is on the SSD and fdatasync-ed; a batch put
shares one sync per segment it touches. In every other mode a put is acknowledged when a tier
holds it in memory, and only what the write-behind queue has written survives a crash.

Failure contract: misses are values (False / 0). Faults of the media (bad checksum, IO errors,
full staging) become misses or dropped saves, counted in ``stats()``. Misuse raises:
ChunkSizeError (wrong buffer size), UnknownNamespaceError (namespace not registered),
PoolClosedError (after close), ArgumentError (a key that is not 16 bytes, keys that are not a
sequence of keys, a namespace or config of the wrong type), ValueError (a malformed buffer).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from time import perf_counter
from typing import Any, cast

from prometheus_client.registry import CollectorRegistry

from kvpool import saves as pipeline
from kvpool.buffers import byte_view
from kvpool.checks import (
    NO_KEYS,
    check_key,
    check_namespace_type,
    check_registered,
    check_same_length,
    check_size,
)
from kvpool.config import Config, load_config
from kvpool.counters import Counters
from kvpool.errors import ArgumentError, PoolClosedError
from kvpool.keys import Namespace
from kvpool.logs import configure_logging
from kvpool.metrics.http import MetricsServer
from kvpool.metrics.pool_collector import PoolCollector
from kvpool.metrics.recorder import OpLatency
from kvpool.mover import Mover
from kvpool.retention import Retention, RetentionBook, TenantQuotas
from kvpool.saves import (
    Fill,
    LoadHandle,
    Pinned,
    SaveBatch,
    SavePipeline,
    SaveTicket,
    Scatter,
    _Deferred,
    stats_of,
)
from kvpool.tiers.base import Tier, leading_run, read_tiers
from kvpool.tiers.directory import ReadDirectory
from kvpool.tiers.dram import DramTier
from kvpool.tiers.slots import PinnedBatch, PinnedView, SlotReservation
from kvpool.tiers.stack import build_tiers
from kvpool.tiers.staging import WriteBehind

log = logging.getLogger("kvpool.pool")


class ChunkReservation:
    """Room for one chunk being filled in place through ``view``; see ``KVPool.reserve``.
    ``commit`` publishes it (what ``put`` would return), ``abort`` gives the room back; the
    first of them wins. ``KVPool.commit_many`` publishes several at once."""

    __slots__ = ("_commit_many", "key", "ns", "slot", "view")

    def __init__(self, ns: Namespace, key: bytes, view: memoryview,
                 slot: SlotReservation | None, commit_many: Callable[
                     [Sequence[ChunkReservation]], int]) -> None:
        self.ns, self.key, self.view, self.slot = ns, key, view, slot
        #: None once committed or aborted.
        self._commit_many: Callable[[Sequence[ChunkReservation]], int] | None = commit_many

    def take(self) -> bool:
        """Claim the reservation for a commit; False if it was committed or aborted."""
        if self._commit_many is None:
            return False
        self._commit_many = None
        return True

    def commit(self) -> bool:
        commit_many = self._commit_many
        return True if commit_many is None else commit_many([self]) == 1

    def abort(self) -> None:
        if self.take() and self.slot is not None:
            self.slot.abort()


class KVPool:
    """Embedded (in-process) pool. ``KVPool()`` uses the YAML config named by $KVPOOL_CONFIG
    (or the defaults) with ``KVPOOL_*`` overrides; pass a Config to be explicit.

    ``metrics`` is the pool's Prometheus registry (integrations add their collectors to it);
    with ``metrics.port`` set (and ``serve_metrics``) it is served over HTTP from here:
    opening raises OSError when that port cannot be bound. With ``events.enabled: true``
    (and ``publish_events``) it publishes KV events of its DRAM and SSD tiers
    (docs/routing.md); opening raises zmq.ZMQError when an events port cannot be bound. A
    storage node passes ``publish_events=False`` and publishes them under its node id."""

    def __init__(self, config: Config | None = None, remote: bool = True,
                 serve_metrics: bool = True, publish_events: bool = True) -> None:
        if config is not None and not isinstance(config, Config):
            raise ArgumentError(f"config must be a kvpool Config (load_config() or "
                                f"config_from_dict({{...}})), got {type(config).__name__}")
        self.config = config if config is not None else load_config()
        if self.config.log.configure:
            configure_logging(self.config.log)
        self._namespaces: dict[bytes, Namespace] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._counters = Counters(  # bumped by callers, the mover thread and IO threads
            "lookups", "lookup_hit_chunks", "dram_hits", "staged_hits", "ssd_hits",
            "remote_hits", "misses", "promotions", "promotions_skipped", "prefetched",
            "prefetch_skipped", "warmed", "warm_skipped")
        pool_cfg = self.config.pool
        #: What saves asked to be kept for (docs/retention.md), and each tenant's bytes.
        self.retention = RetentionBook(int(pool_cfg.max_pinned_fraction
                                           * self.config.dram.capacity))
        self.quotas = TenantQuotas({t: q.model_dump()
                                    for t, q in pool_cfg.tenant_quotas.items()})
        self._ns_retention: dict[bytes, Retention] = {}
        self._stack = build_tiers(self.config, remote, self.retention, self.quotas)
        # the SSD's writers keep each tenant within its SSD quota (none set: no hook)
        self._ssd_gate = self._make_ssd_room \
            if self.quotas.limits_ssd and self._stack.ssd is not None else None
        if self._ssd_gate is not None and self._stack.demoter is not None:
            self._stack.demoter.before_write = self._ssd_gate
        self._tiers = self._stack.tiers
        self._front = self._stack.front
        # the write-through tiers with their places in the read order (latency labels)
        self._through = [(self._tiers.index(t), t) for t in self._stack.through]
        # DRAM hits reported to the SSD, so its eviction keeps what DRAM serves (a restart
        # empties DRAM): None without DRAM or SSD
        self._note_reads = self._stack.ssd.engine.note_reads \
            if self._front is not None and self._stack.ssd is not None else None
        # recorded into while on (None: off); exported once it has been on
        self._latency_recorder = OpLatency([t.label for t in self._tiers])
        self._latency: OpLatency | None = None
        self._latency_exported: OpLatency | None = None
        self.record_latency(self.config.metrics.enabled)
        self.metrics = CollectorRegistry(auto_describe=False)
        self.metrics.register(PoolCollector(self.stats, lambda: self._latency_exported,
                                            [(t.name, t.label) for t in self._tiers]))
        self._metrics_server: MetricsServer | None = None
        self._mover: Mover | None = None
        if self._front is not None and len(self._tiers) > 1:
            self._mover = Mover(self._front, self._stack.lower(), self._counters,
                                self.config.pool.prefetch_max_pending,
                                self.config.pool.prefetch_batch,
                                self.config.pool.background_nice)
        #: A put is acknowledged only once synced on the SSD (see the module docstring).
        self.durable_puts = self._stack.ack is not None
        self.events: Any = None  # the KV event publisher (events.enabled: true), else None
        self._saves = SavePipeline(lambda r: self.commit_many(cast("list[ChunkReservation]", r)),
                                   self._run_deferred,
                                   self.config.pool.save_budget_bytes,
                                   self.config.pool.save_commit_wait_s,
                                   self.config.pool.background_nice)
        port = self.config.metrics.port
        if publish_events and self.config.events.enabled:
            from kvpool.events.attach import start_events
            try:
                self.events = start_events(self, self.config.events.node_id or None,
                                           self.config.events.host or self.config.metrics.host)
            except BaseException:
                self.close()
                raise
        if serve_metrics and port is not None:
            try:
                self._metrics_server = MetricsServer(self.metrics, self.config.metrics.host,
                                                     port)
            except BaseException:
                self.close()
                raise

    def record_latency(self, enabled: bool) -> None:
        """Turn the latency histograms on or off from now on (``metrics.enabled`` sets them at
        open); what they recorded so far stays exported, counters are unaffected. Never
        raises."""
        self._latency = self._latency_recorder if enabled else None
        if enabled:
            self._latency_exported = self._latency_recorder

    @property
    def metrics_url(self) -> str | None:
        """Where this pool serves its metrics (None: not served)."""
        return self._metrics_server.url if self._metrics_server is not None else None

    # ------------------------------------------------------------------ namespaces
    def register_namespace(self, ns: Namespace) -> Namespace:
        """Make a namespace usable. Idempotent. Raises ValueError if its chunk cannot fit a
        DRAM slab or an SSD segment, AuthError if storage nodes refuse this client's token
        for its tenant, ArgumentError if ``ns`` is not a Namespace."""
        self._check_open()
        check_namespace_type(ns)
        new = ns.id not in self._namespaces
        if new:
            for tier in self._tiers:
                tier.register_namespace(ns)
        with self._lock:
            self._namespaces[ns.id] = ns
        if new:
            self._warm(ns)
        return ns

    def _warm(self, ns: Namespace) -> None:
        """Queue the move of the namespace's newest SSD chunks up into DRAM, within
        ``pool.warm_start_fraction`` of its capacity and within what DRAM has free (a
        namespace registered while others fill DRAM never evicts their chunks for its old
        ones); a no-op without DRAM, SSD or mover. Returns at once: what to move is found
        (what DRAM has free, the SSD index's newest records) on the mover's thread. The
        move's faults are misses, as a prefetch's; never raises."""
        fraction = self.config.pool.warm_start_fraction
        ssd, front = self._stack.ssd, self._front
        if self._mover is None or front is None or ssd is None or fraction <= 0:
            return
        engine = ssd.engine

        def newest() -> list[bytes]:
            free = front.capacity - int(front.stats()["used_bytes"])
            return engine.newest(ns.id, min(int(fraction * front.capacity), free))

        # The index sort takes ~0.8 s per million records: on the mover's thread, never the
        # caller's (a storage node registers namespaces on its event loop).
        self._mover.submit_found(ns, newest, "warmed", "warm_skipped")

    def namespaces(self) -> list[Namespace]:
        """The namespaces registered now (the query API resolves a model name with it)."""
        with self._lock:
            return list(self._namespaces.values())

    def tiers(self) -> list[Tier]:
        """The tiers in read order (the query API and the KV events look at them)."""
        return list(self._tiers)

    def unregister_namespace(self, ns: Namespace) -> None:
        """Forget a namespace (a storage node bounds its registry with this). Its chunks stay
        stored: once it is registered again they are served again; until then calls with it
        raise UnknownNamespaceError. Idempotent."""
        with self._lock:
            self._namespaces.pop(ns.id, None)

    def _registered(self, ns: Namespace, keys: Sequence[bytes] | object = NO_KEYS) -> Namespace:
        """``check_registered`` against this pool."""
        return check_registered(self._closed, self._namespaces, ns, keys)

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("KVPool is closed")

    # ------------------------------------------------------------------ writes
    def put(self, ns: Namespace, key: bytes, data: Any,
            retention: Retention | None = None) -> bool:
        """Store one chunk (idempotent: chunks are immutable). True if it is stored as the
        pool's durability promises (see the module docstring: on SSD and synced for durable
        puts, else held by a tier); False if it was dropped under overload or, for a durable
        put, the SSD write failed (counted; the chunk may still be served from DRAM).
        ``retention``: what the save asks to be kept for (docs/retention.md; default: the
        namespace's, ``set_retention``); raises PinLimitError, storing nothing, for a pin
        past ``pool.max_pinned_fraction``."""
        return self.put_many(ns, [key], [data], retention) == 1

    def put_many(self, ns: Namespace, keys: Sequence[bytes], datas: Sequence[Any],
                 retention: Retention | None = None) -> int:
        """Store several chunks; returns how many were stored (as ``put`` counts them).
        Durable puts of one batch share one fdatasync per SSD segment they touch.
        ``retention`` as for ``put``."""
        self._registered(ns, keys)
        check_same_length(keys, datas, "datas")
        views = [byte_view(d) for d in datas]
        for view in views:
            check_size(ns, view, "data")
        self.retain(ns, keys, retention)
        return self._store([(k, ns, v, None) for k, v in zip(keys, views, strict=True)])

    def _store(self, items: Sequence[tuple[bytes, Namespace, memoryview,
                                           SlotReservation | None]]) -> int:
        """The one write path of ``put_many`` and ``commit_many``: the write-through tiers
        first (for durable puts the SSD, written and synced), then DRAM (a filled slot is
        published, otherwise a copy is put, marked as held below so its eviction is no
        demotion). Returns how many count as stored: durable = on the acknowledging tier;
        else held by any tier.

        With a queue that takes pinned slots (``WriteBehind.offer_pinned``: the SSD's, in
        cache mode with ``ssd_write: through``) DRAM goes first instead, and that queue gets
        each chunk's DRAM slot, pinned, rather than a copy of it."""
        latency = self._latency
        started = perf_counter()
        timings: list[tuple[int, float]] = []
        book = self.retention
        front = self._front
        lower = [(k, ns, v) for k, ns, v, _ in items]
        ephemeral = [book.ephemeral(k) for k, _, _ in lower] if len(book) else None
        if ephemeral is not None and any(ephemeral):  # DRAM only: never below it
            lower = [item for item, e in zip(lower, ephemeral, strict=True) if not e]
        if front is not None and self._stack.ack is None and any(
                isinstance(t, WriteBehind) and t.max_pinned for _, t in self._through):
            self._gate_ssd_writes(lower)
            return self._store_dram_first(front, items, ephemeral, started, timings)
        on_lower = [False] * len(items)
        acked = on_lower
        self._gate_ssd_writes(lower)
        for index, tier in self._through:
            tier_started = perf_counter()
            flags = tier.put_many(lower)
            if len(lower) < len(items) and ephemeral is not None:
                kept = iter(flags)
                flags = [False if e else next(kept) for e in ephemeral]
            if latency is not None:
                timings.append((index, perf_counter() - tier_started))
            if tier is self._stack.ack:
                acked = flags
            on_lower = [a or b for a, b in zip(on_lower, flags, strict=True)]
        held = list(on_lower)
        front_started = perf_counter()
        for i, (key, ns, view, slot) in enumerate(items):
            if slot is not None:
                held[i] = slot.commit() or held[i]
                if on_lower[i] and front is not None:
                    front.mark_on_lower(key)
            elif front is not None:
                held[i] = front.put(key, ns, view, on_lower=on_lower[i]) or held[i]
        if front is not None:
            front.note_put_batch([key for key, _, _, _ in items])
            if self._stack.ack is not None:  # durable puts roll the SSD's log themselves
                self._stack.write_back_dropped()
        if latency is not None:
            now = perf_counter()
            if front is not None:
                timings.append((0, now - front_started))
            latency.record_at("put", now - started, timings)
        return sum(acked if self.durable_puts else held)

    def _gate_ssd_writes(self, lower: Sequence[tuple[bytes, Namespace, memoryview]]) -> None:
        """Before ``lower`` (the chunks bound below DRAM) reach a write-through SSD tier:
        make room under each tenant's SSD quota (``_make_ssd_room``). Nothing to do
        without quotas or without such a tier."""
        if self._ssd_gate is not None and lower and any(
                t is self._stack.ssd or t is self._stack.drain_staging for _, t in self._through):
            self._ssd_gate(lower)

    def _store_dram_first(self, front: DramTier,
                          items: Sequence[tuple[bytes, Namespace, memoryview,
                                                SlotReservation | None]],
                          ephemeral: Sequence[bool] | None,
                          started: float, timings: list[tuple[int, float]]) -> int:
        """``_store`` of a cache-mode pool whose write-through queue takes pinned slots:
        publish in DRAM, then hand each queue the chunk's slot, pinned (a chunk DRAM did not
        take, or one over the queue's pinned budget, is offered as a copy), then mark what a
        queue took as held below. An ``ephemeral`` chunk stays in DRAM only. Counts as
        ``_store``."""
        latency = self._latency
        front_started = perf_counter()
        held = [slot.commit() if slot is not None else front.put(key, ns, view)
                for key, ns, view, slot in items]
        front.note_put_batch([key for key, _, _, _ in items])
        if latency is not None:
            timings.append((0, perf_counter() - front_started))
        on_lower = [False] * len(items)
        for index, tier in self._through:
            tier_started = perf_counter()
            for i, (key, ns, view, slot) in enumerate(items):
                if ephemeral is not None and ephemeral[i]:
                    continue
                found = front.view_to_copy(key) if held[i] else None  # no read counted
                pin = found[2] if found is not None else None
                if pin is not None and found is not None and found[0].id != ns.id:
                    pin.release()  # the key is another namespace's chunk
                    pin = None
                took = tier.offer_pinned(key, ns, pin) \
                    if pin is not None and isinstance(tier, WriteBehind) else None
                if took is None and pin is not None:  # not taken pinned: a copy of the slot
                    try:
                        took = tier.put_many([(key, ns, pin.data)])[0]
                    finally:
                        pin.release()
                elif took is None:  # DRAM did not keep it: a copy of the caller's bytes
                    took = tier.put_many([(key, ns, view)])[0] if slot is None else False
                on_lower[i] = on_lower[i] or took
            if latency is not None:
                timings.append((index, perf_counter() - tier_started))
        for i, (key, _, _, _) in enumerate(items):
            if on_lower[i]:
                front.mark_on_lower(key)
        if latency is not None:
            latency.record_at("put", perf_counter() - started, timings)
        return sum(a or b for a, b in zip(held, on_lower, strict=True))

    def reserve(self, ns: Namespace, key: bytes, wait: bool = True,
                retention: Retention | None = None) -> ChunkReservation | bool | None:
        """Room for one chunk that the caller fills in place through ``.view`` (a storage
        node receives a PUT payload straight into a DRAM slot; an engine gathers its KV
        into one), then ``commit()`` (or ``commit_many``) or ``abort()``. Returns True instead
        when the chunk is already stored (in a durable pool: synced on the SSD), False when
        it was dropped for lack of room (counted). With ``wait=False`` it never waits for a
        slot and returns None where it would have waited for a pinned one. Same checks as
        ``put`` (``retention`` included)."""
        check_key(key)
        return self.reserve_many(ns, [key], wait, retention)[0]

    def reserve_many(self, ns: Namespace, keys: Sequence[bytes], wait: bool = True,
                     retention: Retention | None = None
                     ) -> list[ChunkReservation | bool | None]:
        """``reserve`` per key; the tiers are asked once for the batch whether they hold
        the chunks already."""
        self._registered(ns, keys)
        self.retain(ns, keys, retention)
        return self._reserve_many(ns, keys, wait, saving=True)

    def _reserve_many(self, ns: Namespace, keys: Sequence[bytes], wait: bool,
                      saving: bool) -> list[ChunkReservation | bool | None]:
        """``reserve_many`` after the checks; ``saving``: a chunk on its way to a commit
        counts as stored (a deferred save's own chunks must not)."""
        ack = self._stack.ack
        # Durable: stored means synced, whatever DRAM holds.
        stored = ack.contains_many(keys, ns.id) if ack is not None \
            else self._held_locally(ns.id, keys, stop_at_miss=False, saving=saving)
        return [True if held else self._reserve_slot(ns, key, wait)
                for key, held in zip(keys, stored, strict=True)]

    def _reserve_slot(self, ns: Namespace, key: bytes,
                      wait: bool) -> ChunkReservation | bool | None:
        slot = self._front.reserve(key, ns, ns.chunk_bytes, wait=wait) \
            if self._front is not None else True
        if slot is None or slot is False:
            return slot
        if slot is True:  # no DRAM, or DRAM holds it but the acknowledging tier does not
            scratch = memoryview(bytearray(ns.chunk_bytes))
            return ChunkReservation(ns, key, scratch, None, self.commit_many)
        return ChunkReservation(ns, key, slot.view, slot, self.commit_many)

    def commit_many(self, reservations: Sequence[ChunkReservation]) -> int:
        """Publish filled reservations; returns how many are stored, counted as ``put_many``
        counts them. For durable puts this writes and syncs the records first (one sync per
        segment for the whole batch): call it where blocking on an fdatasync is fine, never
        on an event loop. Reservations already committed or aborted are skipped."""
        return self._store([(r.key, r.ns, r.view, r.slot)
                            for r in reservations if r.take()])

    # ------------------------------------------------------------------ retention
    def set_retention(self, ns: Namespace, retention: Retention | None) -> None:
        """What saves of ``ns`` ask for when they name no retention of their own (None: the
        default, NORMAL). Pins set this way count against ``pool.max_pinned_fraction`` as
        each save pins its chunks."""
        self._registered(ns)
        if retention is None or retention.is_default:
            self._ns_retention.pop(ns.id, None)
        else:
            self._ns_retention[ns.id] = retention

    def retain(self, ns: Namespace, keys: Sequence[bytes],
               retention: Retention | None = None) -> None:
        """Record what ``keys`` are to be kept for (saved, or about to be: ``put_many`` and
        ``reserve_many`` call this), and tell the storage nodes (not for ephemeral saves,
        which never reach them). ``retention`` None: the namespace's (``set_retention``),
        or, without one, nothing changes (an explicit ``Retention()`` does: it clears a TTL).
        Raises PinLimitError, recording nothing here, for a pin past
        ``pool.max_pinned_fraction`` (here or on a node: then the local pins are undone)."""
        if retention is None:  # a plain save leaves what earlier ones asked for
            retention = self._ns_retention.get(ns.id)
            if retention is None:
                return
        elif not isinstance(retention, Retention):
            raise ArgumentError(f"retention must be a kvpool Retention, got "
                                f"{type(retention).__name__}")
        self._sweep()
        self.retention.apply(ns, keys, retention)
        if self._stack.remote is not None and not retention.ephemeral \
                and not retention.is_default:
            try:
                self._stack.remote.client.retain(ns, keys, retention)
            except BaseException:
                self.retention.forget(keys)
                raise
        if self._front is not None:
            self._front.retention_changed(keys)

    def release(self, session: str, delete: bool = False) -> int:
        """End a session (the ``session`` its saves named): its chunks that no other session
        and no session-less save holds lose their retention (pins give their bytes back),
        here and on the storage nodes. ``delete=True`` also removes those chunks from every
        tier (a conversation that ended: its prefix will not be asked for again). Returns how
        many chunks were released here. A node that does not answer keeps its pins until
        their deadline (logged, counted by the client)."""
        self._check_open()
        if not isinstance(session, str) or not session:
            raise ArgumentError(f"session must be a non-empty string, got {session!r}")
        freed = self.retention.release(session)
        if delete:
            with self._removing():
                for key, ns in freed:
                    for tier in self._tiers:
                        if tier is not self._stack.remote:  # nodes end it themselves
                            tier.delete(key, ns)
                    self.quotas.forget_ssd(ns, key)
        remote = self._stack.remote
        if remote is not None:
            with self._lock:
                namespaces = list(self._namespaces.values())
            for ns in namespaces:
                remote.client.release(ns, session, delete)
        return len(freed)

    def expire(self) -> int:
        """Remove the chunks whose TTL passed from every tier (DRAM drops them as their
        deadline passes; until this runs a lower tier's copy is a miss all the same).
        Returns how many. May block on the SSD: call it off any event loop."""
        self._check_open()
        self._sweep()
        expired = self.retention.expired_items()
        if not expired:
            return 0
        with self._removing():
            for key, ns in expired:
                for tier in self._tiers:
                    if tier is not self._stack.remote:  # nodes apply the TTL themselves
                        tier.delete(key, ns)
        self.retention.done_expiring([key for key, _ in expired])
        return len(expired)

    def _make_ssd_room(self, items: Sequence[tuple[bytes, Namespace, memoryview]]) -> None:
        """Before ``items`` go to the SSD: delete the oldest SSD chunks of each tenant the
        writes would take past its SSD quota (``pool.tenant_quotas``; its own, never
        another's). The write-behind queue drops its copy (one being written lands first,
        so the tombstone follows it), the SSD's record gets a tombstone; a DRAM copy keeps
        serving. Never raises for a closed SSD."""
        ssd, staging = self._stack.ssd, self._stack.drain_staging
        assert ssd is not None
        for key, ns, view in items:
            for old, old_ns in self.quotas.make_ssd_room(ns, key, view.nbytes):
                if staging is not None:  # a copy being written lands before the tombstone
                    staging.delete(old, old_ns)
                with contextlib.suppress(PoolClosedError):
                    ssd.delete(old, old_ns)

    def _sweep(self) -> None:
        """Apply the retention deadlines passed: chunks whose TTL passed leave DRAM now."""
        due = self.retention.tick()
        if due and self._front is not None:
            for key, _ in due:
                self._front.delete(key)

    def _hidden(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Per key: is it a miss because its TTL passed? None when no key is."""
        self._sweep()
        book = self.retention
        if not book.any_expired:
            return None
        hidden = [book.expired(k) for k in keys]
        return hidden if any(hidden) else None
    # ------------------------------------------------------------------ save / load
    def begin_save(self, ns: Namespace, keys: Sequence[bytes],
                   retention: Retention | None = None) -> SaveBatch:
        """Reserve DRAM slots for saving ``keys`` (a prefix, in order) without waiting: the
        caller fills ``batch.views[i]`` in place (in one pass or layer by layer), then
        ``batch.commit()`` (background; returns a SaveTicket) or ``batch.abort()``. A view is
        None for a chunk already stored or on its way (``batch.present`` counts them) and for
        one dropped: over ``pool.save_budget_bytes`` (the save's tail) or with no free slot,
        counted in ``stats()["saves"]``. Without a DRAM tier the slots are scratch buffers.
        ``retention`` is recorded first (``retain``: PinLimitError for a pin past the
        bound, nothing reserved). Same checks as ``put``."""
        self._registered(ns, keys)
        self.retain(ns, keys, retention)
        return pipeline.begin_save(self, self._saves, ns, list(keys))

    def reserve_for_save(self, ns: Namespace, keys: Sequence[bytes],
                         saving: bool) -> list[ChunkReservation | bool | None]:
        """The save pipeline's reservation (``saves.SaveSide``): never waits for a slot."""
        return self._reserve_many(ns, keys, False, saving=saving)

    def save(self, ns: Namespace, keys: Sequence[bytes], fill: Fill, *,
             defer: bool = False, retention: Retention | None = None) -> SaveTicket:
        """Save chunks whose payloads the caller writes straight into their DRAM slots:
        ``fill(i, view)`` for each chunk ``keys[i]`` that needs storing (never for one already
        stored or dropped, see ``begin_save``). The commit runs in the background; the saved
        chunks count for ``lookup`` / ``contains`` as soon as this returns and a read of them
        waits for the commit (``pool.save_commit_wait_s``). Returns a ticket (``wait()``,
        then ``stored``).

        ``defer=True``: reserving and filling run on the pool's save thread too (at
        ``pool.background_nice``), so this returns at once; ``fill`` must read memory that
        stays valid until the ticket is done. An exception from ``fill`` aborts this save's
        slots (counted as ``save_dropped_fill``); inline it is re-raised, deferred it is
        logged. Same checks as ``put``."""
        self._registered(ns, keys)
        self.retain(ns, keys, retention)
        if not defer:
            return pipeline.save_inline(self, self._saves, ns, list(keys), fill)
        ticket = SaveTicket(keys, 0)
        self._saves.defer(_Deferred(ns, list(keys), fill, ticket))
        return ticket

    def _run_deferred(self, job: _Deferred) -> int:
        return pipeline.run_deferred(self, self._saves, job, self._closed)

    def open_load(self, ns: Namespace, keys: Sequence[bytes]) -> LoadHandle:
        """Make ``keys`` readable in place: wait for the commits of those being saved
        (``pool.save_commit_wait_s``), pin the DRAM-resident ones, read the ones only slower
        tiers hold straight into free DRAM slots and pin them (that read is their promotion),
        and read what finds no slot into the pool's staging buffers. ``handle.sources[i]``
        is chunk i's payload (None: a miss, or a chunk that failed its checksum), and
        ``handle.loaded`` how many leading chunks are there. Release the handle. Same checks
        as ``get_many_into``; a tier fault is a miss."""
        self._registered(ns, keys)
        return pipeline.open_load(self, self._saves, ns, list(keys))

    def pin_for_load(self, ns: Namespace, keys: Sequence[bytes]) -> list[Pinned | None]:
        """The load pipeline's pins (``saves.SaveSide``): DRAM's, fetching lower tiers'."""
        if self._front is None:
            return [None] * len(keys)
        return list(self._pin(ns, keys, True))

    def read_for_load(self, ns: Namespace, keys: Sequence[bytes],
                      views: list[memoryview]) -> list[bool]:
        return self._read_into(ns, keys, views)

    def load(self, ns: Namespace, keys: Sequence[bytes], scatter: Scatter) -> int:
        """Deliver the longest leading run of ``keys`` the pool can: ``scatter(i, view)`` for
        each chunk ``keys[i]`` of the run, in order, from a read-only view of its payload
        valid only during the call (see ``open_load`` for where it comes from). Returns the
        run's length: the engine recomputes from ``keys[returned]``. An exception from
        ``scatter`` releases everything and is re-raised."""
        return pipeline.load(self.open_load(ns, keys), scatter)

    # ------------------------------------------------------------------ reads
    def get_into(self, ns: Namespace, key: bytes, out: Any) -> bool:
        """Copy a chunk's payload into ``out`` (exactly ns.chunk_bytes, writable). False on a
        miss; on a miss the contents of ``out`` are unspecified. A chunk served from DRAM
        also counts as a read of its SSD record (``SsdEngine.note_reads``), so the SSD's
        segment eviction copies it forward rather than dropping what DRAM serves."""
        return self.get_many_into(ns, [key], [out])[0]

    def get_many_into(self, ns: Namespace, keys: Sequence[bytes],
                      outs: Sequence[Any]) -> list[bool]:
        """Batched get_into: each tier in order is asked for what the faster ones lacked (SSD
        reads run in parallel). Chunks found below DRAM are promoted in the background (with
        ``pool.promote_on_hit``)."""
        self._registered(ns, keys)
        check_same_length(keys, outs, "outs")
        hidden = self._hidden(keys)
        if hidden is not None:  # expired: misses, the rest read as usual
            live = [i for i, h in enumerate(hidden) if not h]
            got = self.get_many_into(ns, [keys[i] for i in live], [outs[i] for i in live])
            self.count_misses(ns, len(keys) - len(live))
            found = [False] * len(keys)
            for i, hit in zip(live, got, strict=True):
                found[i] = hit
            return found
        views = [byte_view(o, writable=True) for o in outs]
        for view in views:
            check_size(ns, view, "output buffer")
        self._saves.wait_committed(ns.id, keys)
        return self._read_into(ns, keys, views)

    def _read_into(self, ns: Namespace, keys: Sequence[bytes],
                   views: Sequence[memoryview]) -> list[bool]:
        """``get_many_into`` after its checks and its wait for commits."""
        started = perf_counter()
        timings: list[float] | None = [] if self._latency is not None else None
        counts: dict[str, int] = {}
        served = read_tiers(self._tiers, ns, keys, views, counts, timings)
        if self._note_reads is not None:
            from_dram = served.count(0)  # the front is tier 0
            if from_dram:
                self._note_reads(keys if from_dram == len(keys) else
                                 [k for k, tier in zip(keys, served, strict=True) if tier == 0])
        misses = served.count(-1)
        if misses:
            counts["misses"] = misses
            counts["miss_tokens"] = misses * ns.layout.chunk_tokens
        self._counters.add_many(counts)
        if self._mover is not None and self.config.pool.promote_on_hit:
            below = [k for k, tier in zip(keys, served, strict=True) if tier > 0]
            if below:
                self._mover.submit(ns, below, "promotions", "promotions_skipped", False)
        if self._latency is not None and timings is not None:
            self._latency.record("get", perf_counter() - started, timings)
        return [tier >= 0 for tier in served]

    def prefetch(self, ns: Namespace, keys: Sequence[bytes]) -> Future[int] | None:
        """Start copying the chunks that only slower tiers hold (SSD, storage nodes) up into
        DRAM, in the background, so a load that follows a lookup finds them there. Returns a
        future of how many were promoted, or None when there is nothing to do: no DRAM tier,
        everything already in DRAM, or ``pool.prefetch_max_pending`` moves already queued
        (the request is skipped and counted, never waited for). Faults are misses, as in reads."""
        self._registered(ns, keys)
        if self._mover is None:
            return None
        return self._mover.submit(ns, keys, "prefetched", "prefetch_skipped", True)

    def pin_many(self, ns: Namespace, keys: Sequence[bytes],
                 fetch: bool = False) -> list[PinnedView | None]:
        """Zero-copy, read-only views of the chunks resident in DRAM (None for the others,
        which get_many_into can still fetch). Each view pins its slot until ``release()``:
        release every one, or the slots can never be evicted. A key not pinned is not
        counted as a DRAM miss here: the get_many_into that fetches it counts it, so one
        read of a chunk counts at most one DRAM miss.

        ``fetch=True``: the chunks only slower tiers hold are first read, in this thread,
        straight into free DRAM slots and pinned there, so the load's own read is also the
        promotion (no scratch buffer, no second read in the background). A chunk that finds
        no free slot, or whose read fails, stays None.

        A call is a ``get`` in the latency metrics (engines read DRAM this way), DRAM's part
        being the pinning."""
        self._registered(ns, keys)
        if self._front is None:
            return [None] * len(keys)
        self._saves.wait_committed(ns.id, keys)
        return self._pin(ns, keys, fetch)

    def pin_resident(self, ns: Namespace, keys: list[bytes],
                     views: bool = True) -> PinnedBatch | None:
        """``pin_many`` for a caller that already checked its arguments (a storage node's
        GET: ``ns`` is held registered by the node's registry, ``keys`` are its own 16-byte
        digests): the resident chunks pinned under one DRAM lock acquisition, as one
        PinnedBatch rather than a PinnedView per key, with the same counts, SSD read notes
        and latency as ``pin_many``, made when the batch is released (after a node sent the
        bytes: they are not on the answer's path); without ``views``, their offsets only (a
        host pool). None without DRAM. Raises PoolClosedError after close."""
        front = self._front
        if front is None:
            return None
        self._saves.wait_committed(ns.id, keys)
        started = perf_counter()
        batch = front.pin_batch(keys, ns.id, views)
        took = perf_counter() - started
        offsets = batch.offsets  # not the batch: a cycle would keep a dropped one pinned
        batch.after_release = lambda: self._count_pins(ns, keys, offsets, took)
        return batch

    def _count_pins(self, ns: Namespace, keys: list[bytes], offsets: list[int | None],
                    took: float) -> None:
        """A released ``pin_resident`` batch's bookkeeping, after its bytes were sent: DRAM
        hits, the SSD's read notes, the get latency (``took``: the pins' own time)."""
        pinned = len(offsets) - offsets.count(None)
        if pinned and self._note_reads is not None:
            self._note_reads(keys if pinned == len(keys) else
                             [k for k, off in zip(keys, offsets, strict=True)
                              if off is not None])
        self._counters.add_many({"dram_hits": pinned, "dram_hit_bytes": pinned * ns.chunk_bytes,
                                 "dram_hit_tokens": pinned * ns.layout.chunk_tokens})
        if self._latency is not None:
            self._latency.record("get", took, (took,))

    def share_directory(self, directory: ReadDirectory) -> bool:
        """Publish where DRAM's chunks lie in ``directory`` from now on (a host pool's
        tenant pool: tiers/directory.py); the DRAM tier closes it with itself. False (and
        nothing kept) without a DRAM tier."""
        if self._front is None:
            return False
        self._front.share_directory(directory)
        return True

    def note_dram_reads(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        """Count reads an attached engine made through the directory, as ``pin_resident``
        counts its pins (DRAM hits and policy recency, the SSD's read notes, dram_hits),
        afterwards; keys evicted since are ignored. Returns how many were counted."""
        if self._front is None:
            return 0
        counted = self._front.note_reads(keys, ns.id)
        if counted and self._note_reads is not None:
            self._note_reads(keys)
        self._counters.add_many({"dram_hits": counted,
                                 "dram_hit_bytes": counted * ns.chunk_bytes,
                                 "dram_hit_tokens": counted * ns.layout.chunk_tokens})
        return counted

    def _pin(self, ns: Namespace, keys: Sequence[bytes],
             fetch: bool) -> list[PinnedView | None]:
        """``pin_many`` after its checks and its wait for commits (DRAM present)."""
        assert self._front is not None
        started = perf_counter()
        views = [self._front.view(key, ns.id, count_miss=False) for key in keys]
        pinned_s = perf_counter() - started
        pinned = sum(v is not None for v in views)
        if pinned and self._note_reads is not None:
            self._note_reads(keys if pinned == len(keys) else
                             [k for k, v in zip(keys, views, strict=True) if v is not None])
        self._counters.add_many({"dram_hits": pinned, "dram_hit_bytes": pinned * ns.chunk_bytes,
                                 "dram_hit_tokens": pinned * ns.layout.chunk_tokens})
        if fetch and self._mover is not None:
            missing = [i for i, v in enumerate(views) if v is None]
            if missing:  # moved by this call or by a move it waited for
                self._mover.move_now(ns, [keys[i] for i in missing])
                for i in missing:
                    views[i] = self._front.view(keys[i], ns.id, count_miss=False)
        if self._latency is not None:
            self._latency.record("get", perf_counter() - started, (pinned_s,))
        return views

    def _held_locally(self, ns_id: bytes, keys: Sequence[bytes],
                      stop_at_miss: bool, saving: bool = True) -> list[bool]:
        """Per key: does a tier know, in this process, that it holds it? Each tier is asked
        once for the keys the faster ones lack. ``stop_at_miss``: only the leading run
        matters (a lookup), so the answer is cut at the first key no tier holds.
        ``saving``: a chunk on its way to a commit (``save``) counts as held
        (read-your-writes)."""
        if not self._tiers:
            return [] if stop_at_miss else [False] * len(keys)
        first, *slower = self._tiers
        held = list(first.contains_many(keys, ns_id))  # the common probe: one tier has all
        todo = [i for i, flag in enumerate(held) if not flag]
        if todo and saving:
            flags = self._saves.saving(ns_id, [keys[i] for i in todo])
            for i, flag in zip(todo, flags, strict=True):
                held[i] = flag
            todo = [i for i, flag in zip(todo, flags, strict=True) if not flag]
        if not slower:
            todo = []
        for tier in slower:
            if not todo:
                break
            flags = tier.contains_many([keys[i] for i in todo], ns_id)
            for i, flag in zip(todo, flags, strict=True):
                held[i] = flag
            todo = [i for i, flag in zip(todo, flags, strict=True) if not flag]
        hidden = self._hidden(keys)
        if hidden is not None:  # expired: a miss wherever a copy is left
            held = [h and not e for h, e in zip(held, hidden, strict=True)]
        return held[:leading_run(held)] if stop_at_miss else held

    def lookup(self, ns: Namespace, keys: Sequence[bytes], *, prefetch: int = 0) -> int:
        """Length of the longest leading run of ``keys`` present in any tier: what the tiers
        know locally first (each asked once, for what the faster ones lack), then, for the
        rest, each tier's own lookup (storage nodes: one batched EXISTS per node).

        ``prefetch`` > 0 reads ahead along the prefix: the first ``prefetch`` chunks of the
        run that DRAM lacks are moved up into DRAM in the background, as :meth:`prefetch`
        moves them (a move already queued ``pool.prefetch_max_pending`` times over is
        skipped and counted, never waited for; a chunk removed meanwhile is not brought
        back), so the load that follows finds them in DRAM. Integrations pass
        ``pool.prefetch_window_chunks``. Raises ValueError for a negative ``prefetch``."""
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0 chunks, got {prefetch}")
        self._registered(ns, keys)
        hidden = self._hidden(keys)
        if hidden is not None:  # the run ends at the first chunk whose TTL passed
            keys = keys[:hidden.index(True)]
        started = perf_counter()
        timings: list[float] = []  # entry i: tier i (asked in order from the first)
        n = len(self._held_locally(ns.id, keys, stop_at_miss=True))
        for tier in self._tiers:
            if n == len(keys):
                break
            tier_started = perf_counter()
            n += tier.lookup(ns, keys[n:])
            timings.append(perf_counter() - tier_started)
        self._counters.add_many({"lookups": 1, "lookup_hit_chunks": n})
        if self._latency is not None:
            self._latency.record("lookup", perf_counter() - started, timings)
        if prefetch and n and self._mover is not None:
            self._mover.submit(ns, keys[:n], "prefetched", "prefetch_skipped", True,
                               limit=prefetch)
        return n

    def contains(self, ns: Namespace, key: bytes) -> bool:
        """True if a tier knows, without asking storage nodes, that it holds the chunk (DRAM,
        staging, SSD, the cluster's save queue)."""
        check_key(key)
        return self.contains_many(ns, [key])[0]

    def count_misses(self, ns: Namespace, n: int) -> None:
        """Count ``n`` reads of ``ns`` as misses, as get_many_into would have: for a reader
        that probed ``contains_many`` first and reads only the chunks a tier holds (a storage
        node, so a miss costs it no buffer). The tiers' own figures count reads only."""
        if n > 0:
            self._counters.add_many({"misses": n, "miss_tokens": n * ns.layout.chunk_tokens})

    def contains_many(self, ns: Namespace, keys: Sequence[bytes]) -> list[bool]:
        """``contains`` per key, each tier asked once for the batch."""
        self._registered(ns, keys)
        return self._held_locally(ns.id, keys, stop_at_miss=False)

    def mark_saving(self, ns: Namespace, keys: Sequence[bytes], on: bool) -> None:
        """Count ``keys`` as on their way to a commit (``on``), or no longer: the host pool
        marks what an attached engine handed to its committer, so every engine's lookups
        count it and its reads wait for the commit, as for this pool's own saves."""
        (self._saves.mark if on else self._saves.unmark)(ns.id, keys)

    def held_many(self, ns: Namespace, keys: list[bytes]) -> list[bool]:
        """``contains_many`` for a caller that already checked its arguments (a storage
        node: ``ns`` is held registered by its registry, ``keys`` are its own 16-byte
        digests), without the per-call checks (a 512-key EXISTS spent a fifth of its time
        re-checking keys). Raises PoolClosedError after close."""
        self._check_open()
        return self._held_locally(ns.id, keys, stop_at_miss=False)

    def saving_many(self, ns: Namespace, keys: Sequence[bytes]) -> list[bool]:
        """Per key: is it on its way to a commit (saved, not yet published)? Same checks as
        contains."""
        self._registered(ns, keys)
        return self._saves.saving(ns.id, keys)

    def resident_many(self, ns: Namespace, keys: Sequence[bytes]) -> list[bool]:
        """Per key: does the DRAM tier hold it now (all False without DRAM)? For a node's
        repair, which copies the chunks DRAM serves first. Same checks as contains."""
        self._registered(ns, keys)
        if self._front is None:
            return [False] * len(keys)
        return list(self._front.contains_many(keys, ns.id))

    def peek_many_into(self, ns: Namespace, keys: Sequence[bytes],
                       outs: Sequence[Any]) -> list[bool]:
        """get_many_into without its side effects on the pool's figures and placement: no
        hit or miss counts, no latency, no promotion into DRAM (a node's repair reads every
        chunk it copies, and must not evict the hot set for cold ones). Same errors."""
        self._registered(ns, keys)
        check_same_length(keys, outs, "outs")
        views = [byte_view(o, writable=True) for o in outs]
        for view in views:
            check_size(ns, view, "output buffer")
        return [tier >= 0 for tier in read_tiers(self._tiers, ns, keys, views, None)]

    def touch(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        """Count ``keys`` as just read, without moving bytes: the DRAM eviction policy sees a
        hit and the SSD index marks them hot (copied forward when their segment is evicted).
        A storage node does this for its replica copies that another replica served, on its
        event loop: no tier waits (while another thread holds the SSD index's lock the mark
        is queued for it, counted as ssd touch_deferred). Returns how many keys a tier
        touched; keys held nowhere are ignored. Same checks as lookup."""
        self._registered(ns, keys)
        touched = [False] * len(keys)
        for tier in self._tiers:
            touched = [a or b for a, b in zip(touched, tier.touch_many(keys), strict=True)]
        return sum(touched)

    # ------------------------------------------------------------------ removal
    def delete(self, ns: Namespace, key: bytes) -> bool:
        """Remove a chunk from every tier; True if any tier held it."""
        self._registered(ns)
        check_key(key)
        removed = False
        with self._removing():  # a move in flight must not bring the chunk back
            for tier in self._tiers:  # staging first: a chunk being written lands before the
                removed |= tier.delete(key, ns)  # SSD's tombstone
        self.retention.forget([key])
        self.quotas.forget_ssd(ns, key)
        return removed

    def invalidate(self, ns: Namespace | bytes) -> int:
        """Drop every chunk of a namespace in every tier (persisted on SSD). Accepts a
        Namespace or a 16-byte namespace id, registered or not. Returns the copies dropped,
        summed over tiers (a chunk held in DRAM and on SSD counts twice)."""
        self._check_open()
        ns_id = ns.id if isinstance(ns, Namespace) else bytes(ns)
        known = ns if isinstance(ns, Namespace) else self._namespaces.get(ns_id)
        with self._removing():
            dropped = sum(tier.invalidate(ns_id, known) for tier in self._tiers)
        self.retention.forget_namespace(ns_id)
        return dropped

    def _removing(self) -> contextlib.AbstractContextManager[None]:
        return self._mover.removing() if self._mover is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ admin
    def flush(self, timeout: float | None = None) -> bool:
        """Wait for background moves up (promotions, prefetches) and the write-behind queues
        (SSD, cluster) to drain, after removing what expired (``expire``); False on
        timeout."""
        self._check_open()
        self.expire()
        saved = self._saves.flush(timeout)
        ok = self._mover.wait_idle(timeout) if self._mover is not None else True
        return all([tier.flush(timeout) for tier in self._tiers]) and ok and saved

    def stats(self) -> dict[str, Any]:
        """Counters per tier: hits, misses, evictions, checksum failures, dropped saves..."""
        self._check_open()
        out: dict[str, Any] = {"pool": self._counters.snapshot(),
                               "retention": {**self.retention.stats(),
                                             "tenants": self.quotas.stats()}}
        if self._stack.demoter is not None:
            out["pool"].update(self._stack.demoter.demoted.snapshot())
        if self._mover is not None:
            out["pool"]["mover_pending"] = self._mover.pending()
        out["saves"] = stats_of(self._saves)
        for tier in self._tiers:
            *path, leaf = tier.stats_key
            node = out
            for part in path:
                node = node.setdefault(part, {})
            node[leaf] = tier.stats()
        return out

    def close(self) -> None:
        """Stop background moves, write staged chunks down, then release every tier.
        Idempotent."""
        if self._closed:
            return
        saves = getattr(self, "_saves", None)  # None: the constructor failed before it
        if saves is not None:
            saves.close()  # commits what was handed over, while the tiers are open
        self._closed = True
        if self._metrics_server is not None:
            self._metrics_server.close()
        if self._mover is not None:
            self._mover.close()
        self._stack.close()
        if self.events is not None:
            self.events.close()

    def __enter__(self) -> KVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
