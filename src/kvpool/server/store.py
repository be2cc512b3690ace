"""What a storage node does with a request once its frame is read: the NodeStore.

The transport (connection.py) reads frames, enforces the limits and moves payload bytes; the
store decides what each request means for the embedded KVPool: who a connection is (AUTH),
which namespaces it declared (NAMESPACE, bounded per connection and node-wide by the
registry), which chunk keys it may reach (scoped by namespace), what is stored, found,
touched, removed, and what STATS shows to whom. It knows nothing of sockets, so it is tested
by driving it directly (tests/net/test_node_store.py).

Payloads never pass through a staging copy: a PUT reserves DRAM slots and hands their views
to the transport to receive into (:class:`PutBatch`); a GET pins the chunks resident in DRAM
and hands out read-only views of them to send from (:class:`GetAnswer`), the rest read from
the lower tiers into per-request buffers: only for the keys a lower tier's in-memory index
says it holds, so a miss costs no payload memory. Those buffers and a PUT's reserved slots
are held in the node's ledger (held.py: server.max_held_bytes, per tenant with auth on) until
the answer is sent or the PUT committed; past its limits a GET is refused BUSY and a PUT
keeps the chunks that fit (BUSY when none does).

Every operation has one implementation and runs on the calling thread: the transport serves
each connection on a thread of its own (connection.py), so lower-tier reads, waits for pinned
slots and durable syncs block only the connection that asked. Nothing here runs on the node's
event loop (it only accepts connections and runs timers).

Failure contract: a request the node answers wrongly-but-safely (unknown namespace, forbidden
tenant, too many bytes for one answer, a bad namespace declaration) raises :class:`Refused`
with the status to answer; ``close`` says whether the connection must end afterwards. A PUT
whose payload size does not match its keys raises ProtocolError (the frame cannot be
trusted). Anything else the pool raises propagates.

Thread-safe: called from every connection's thread at once (the sessions, the registry,
the ledger and the counters, the tenants' included, take locks; the pool is thread-safe).
"""

from __future__ import annotations

import gc
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from kvpool import __version__
from kvpool.config import ServerConfig
from kvpool.counters import Counters
from kvpool.keys import Namespace
from kvpool.net.protocol import FEATURES, ProtocolError, Status
from kvpool.pool import ChunkReservation, KVPool
from kvpool.server.auth import Authenticator
from kvpool.server.catalog import KeyCatalog
from kvpool.server.held import HeldBytes, derived_limit
from kvpool.server.registry import NamespaceRegistry, RegistryFull
from kvpool.server.tenants import TenantCounters
from kvpool.tiers.slots import PinnedBatch


class Refused(Exception):
    """A request answered with an error status; ``close`` ends the connection afterwards."""

    def __init__(self, status: Status, message: str, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.close = status, message, close


def scoped_chunk_key(ns_id: bytes, key: bytes) -> bytes:
    """The key a node files a client's chunk key under: scoped by namespace, so a key
    presented under another tenant's namespace can never reach this one's bytes."""
    return bytes(xxhash.xxh3_128_digest(ns_id + key))


def scoped_chunk_keys(ns_id: bytes, keys: Sequence[bytes]) -> list[bytes]:
    """``scoped_chunk_key`` of each key (one comprehension: a third of the per-key cost)."""
    digest = xxhash.xxh3_128_digest
    return [digest(ns_id + key) for key in keys]


class Session:
    """One connection as the store sees it: its identity and the namespaces it declared
    since its last AUTH (each holding a reference in the node's registry)."""

    __slots__ = ("admin", "namespaces", "peer", "tenants")

    def __init__(self, tenants: frozenset[str] | None, peer: str | None = None) -> None:
        #: Tenants it may act for; None until AUTH succeeds (auth on).
        self.tenants = tenants
        self.peer = peer  # the client's address, for the log (None: the transport gave none)
        self.admin = False  # AUTH with server.admin_token: node-wide STATS
        self.namespaces: dict[bytes, Namespace] = {}

    @property
    def authenticated(self) -> bool:
        return self.tenants is not None


@dataclass(slots=True)
class PutBatch:
    """Room for one PUT's chunks, in key order. The transport receives chunk ``i`` into
    ``targets[i]``, or, where that is None (already stored, or dropped for lack of room),
    reads and discards ``ns.chunk_bytes``; then ``NodeStore.commit_put``. Call ``abort()`` in
    a ``finally``: it gives back every slot not committed, so a half-received chunk is never
    published (a no-op after the commit)."""

    ns: Namespace
    targets: list[memoryview | None]
    _slots: list[ChunkReservation | bool] = field(repr=False)
    #: Gives back the bytes the reserved slots hold in the node's ledger (held.py).
    _give_back: Callable[[], None] | None = field(default=None, repr=False)

    def abort(self) -> None:
        for slot in self._slots:
            if not isinstance(slot, bool):
                slot.abort()
        self.release()

    def release(self) -> None:
        """Give the ledger back its bytes (idempotent; the slots are the caller's)."""
        give_back, self._give_back = self._give_back, None
        if give_back is not None:
            give_back()


@dataclass(slots=True)
class GetAnswer:
    """One GET's answer: a found-flag per key and the payload of each found chunk in key
    order (views of pinned DRAM slots or of per-request buffers). Valid until ``release()``,
    which the transport calls in a ``finally`` once the views are sent (idempotent; also run
    when collected); until then the pinned slots cannot be evicted."""

    flags: bytes
    views: list[memoryview]
    _pins: PinnedBatch | None = field(repr=False)
    #: Run once by ``release`` after the pins: gives back the bytes the per-request buffers
    #: hold in the node's ledger (held.py), or counts an all-DRAM answer after its send.
    _after: Callable[[], None] | None = field(default=None, repr=False)

    def release(self) -> None:
        pins, self._pins = self._pins, None
        if pins is not None:
            pins.release()
        after, self._after = self._after, None
        if after is not None:
            after()

    def __del__(self) -> None:  # a dropped answer gives back its pins, bytes and counts
        self.release()


def _unknown(ns_id: bytes) -> Refused:
    return Refused(Status.UNKNOWN_NAMESPACE, f"namespace {ns_id.hex()} was not declared on "
                   "this connection since its last AUTH (send NAMESPACE first)")


class NodeStore:
    """The requests of one node against ``pool``; ``counters`` are the node's (the transport
    counts there too, and STATS shows them)."""

    def __init__(self, pool: KVPool, cfg: ServerConfig, node_id: str) -> None:
        self.pool = pool
        self.cfg = cfg
        self.node_id = node_id
        self.auth = Authenticator(cfg.auth, cfg.admin_token)
        self.counters = Counters()
        self.tenant_counts = TenantCounters(self.auth.tenants)
        self.namespaces = NamespaceRegistry(pool, cfg.max_namespaces)
        self.started = time.time()
        #: Where ``drained`` is read from: node.py sets it to this node's flag in etcd.
        self.drain_flag: Callable[[], bool] = lambda: False
        #: Where PUTs note their client keys for the node's repair (server/catalog.py).
        self.catalog: KeyCatalog | None = None
        self._sessions: set[Session] = set()
        self._sessions_lock = threading.Lock()
        dram = pool.config.dram.capacity
        limit = derived_limit(cfg.max_held_bytes, dram)
        #: Bytes held for GET answers and PUT receives in progress, and their limits: shares
        #: per tenant with auth on (without auth a tenant is whatever salt a client picks).
        if self.auth.enabled:
            share = cfg.tenant_held_share
            self.held = HeldBytes(limit, int(limit * share), int(dram * share) if dram else None)
        else:
            self.held = HeldBytes(limit, limit, None)

    @property
    def drained(self) -> bool:
        """True while ``kvpool admin drain`` has drained this node (clients place no new
        chunks here; reads continue). STATS shows it as ``server.draining``."""
        return self.drain_flag()

    def _count_tenant(self, ns: Namespace, **counts: int) -> None:
        """Add ``counts`` to the tenant of ``ns``: only with auth on (``ns.tenant`` splits
        a string, not worth doing per request when nothing reads the counts)."""
        if self.auth.enabled:
            tenant = ns.tenant
            for name, n in counts.items():
                self.tenant_counts.add(tenant, name, n)

    # ------------------------------------------------------------------ sessions
    def open_session(self, peer: str | None = None) -> Session:
        """A new connection (from ``peer``, host:port): authenticated at once when auth is off."""
        session = Session(None if self.auth.enabled else frozenset(), peer)
        with self._sessions_lock:
            self._sessions.add(session)
        return session

    def close_session(self, session: Session) -> None:
        """The connection ended: give back its namespaces. Idempotent."""
        self._drop_namespaces(session)
        with self._sessions_lock:
            self._sessions.discard(session)

    def _drop_namespaces(self, session: Session) -> None:
        for ns in session.namespaces.values():
            self.namespaces.release(ns)
        session.namespaces.clear()

    def authenticate(self, session: Session, token: bytes) -> bytes:
        """AUTH: a new identity that starts with nothing declared (what the previous token
        declared must not stay reachable under this one). Returns the hello to answer with.
        Raises Refused(AUTH_FAILED, close) for an unknown token (counted, logged: auth.py)."""
        self._drop_namespaces(session)
        if not self.auth.enabled:
            session.tenants = frozenset()
            return self._hello(session, ["*"])
        session.tenants, session.admin = None, False
        if self.auth.is_admin(token):
            session.tenants, session.admin = frozenset(), True
            return self._hello(session, [])
        tenants = self.auth.tenants_for(token)
        if tenants is None:
            self.counters.add("auth_failures")
            self.auth.log_failure(self.node_id, session.peer)
            raise Refused(Status.AUTH_FAILED, "unknown token", close=True)
        session.tenants = tenants
        return self._hello(session, sorted(tenants))

    def _hello(self, session: Session, tenants: list[str]) -> bytes:
        return json.dumps({"node_id": self.node_id, "tenants": tenants,
                           "admin": session.admin}).encode()

    def declare(self, session: Session, meta: bytes) -> tuple[int, bytes]:
        """NAMESPACE: declare the canonical namespace in ``meta`` on this session. Returns
        (the feature bits, the namespace id) to answer with. Raises Refused: BAD_REQUEST for
        a malformed namespace or one past server.max_namespaces_per_connection, FORBIDDEN
        for another tenant's, TOO_LARGE for chunks over max_item_bytes (or that no tier can
        hold), BUSY when the node's registry is full of namespaces in use."""
        try:
            ns = Namespace.from_canonical(json.loads(meta))
        except (ValueError, UnicodeDecodeError) as exc:
            raise Refused(Status.BAD_REQUEST, f"bad namespace: {exc}") from None
        if self.auth.enabled and ns.tenant not in (session.tenants or ()):
            raise Refused(Status.FORBIDDEN, f"namespace of tenant {ns.tenant!r} is not "
                          "allowed for this token")
        if ns.chunk_bytes > self.cfg.max_item_bytes:
            raise Refused(Status.TOO_LARGE, f"chunks of {ns.chunk_bytes} bytes exceed "
                          f"max_item_bytes {self.cfg.max_item_bytes}")
        if ns.id not in session.namespaces:
            limit = self.cfg.max_namespaces_per_connection
            if len(session.namespaces) >= limit:
                raise Refused(Status.BAD_REQUEST, f"more than server.max_namespaces_per_"
                              f"connection={limit} namespaces on one connection")
            try:
                self.namespaces.acquire(ns)
            except RegistryFull as exc:
                self.counters.add("namespaces_refused")
                raise Refused(Status.BUSY, str(exc)) from None
            except ValueError as exc:
                raise Refused(Status.TOO_LARGE, str(exc)) from None
            session.namespaces[ns.id] = ns
            self._count_tenant(ns, namespaces_declared=1)
        return FEATURES, ns.id

    def _namespace_of(self, session: Session, ns_id: bytes) -> Namespace:
        ns = session.namespaces.get(ns_id)
        if ns is None:
            raise _unknown(ns_id)
        self._count_tenant(ns, requests=1)
        return ns

    def _scoped(self, session: Session, ns_id: bytes,
                keys: Sequence[bytes]) -> tuple[Namespace, list[bytes]]:
        ns = self._namespace_of(session, ns_id)
        return ns, scoped_chunk_keys(ns_id, keys)

    # ------------------------------------------------------------------ writes
    def begin_put(self, session: Session, ns_id: bytes, keys: Sequence[bytes],
                  payload_len: int) -> PutBatch:
        """Reserve room for a PUT of ``keys`` carrying ``payload_len`` bytes, within the
        node's held-bytes limits (held.py): chunks past them are dropped as for lack of room;
        waits for pinned slots if it must (blocking only the caller's connection). Raises
        Refused (the transport must still read the payload away): UNKNOWN_NAMESPACE, BUSY
        when no chunk fits; ProtocolError when the payload is not one chunk per key."""
        ns, scoped = self._put_scope(session, ns_id, keys, payload_len)
        room = self._put_room(ns, len(scoped))
        try:
            slots = self._reserve(ns, scoped, room)
        except BaseException:
            self.held.give(ns.tenant, room * ns.chunk_bytes, put=True)
            raise
        return self._put_batch(ns, slots, room)

    def _put_room(self, ns: Namespace, count: int) -> int:
        """Take room in the ledger for up to ``count`` chunks of ``ns``; how many. Raises
        Refused(BUSY) when a non-empty PUT finds room for none."""
        room = self.held.take(ns.tenant, count, ns.chunk_bytes, put=True)
        if count and not room:
            self.counters.add("held_refused")
            raise Refused(Status.BUSY, f"PUT refused: {self.held.describe(ns.tenant)}")
        return room

    def _put_batch(self, ns: Namespace, slots: list[ChunkReservation | bool],
                   room: int) -> PutBatch:
        """The batch over ``slots``; the ledger keeps the bytes of its reservations (given
        back by the batch's abort) and gets the rest of ``room`` back now."""
        reserved = sum(not isinstance(s, bool) for s in slots)
        held, tenant = reserved * ns.chunk_bytes, ns.tenant
        self.held.give(tenant, (room - reserved) * ns.chunk_bytes, put=True)
        targets = [None if isinstance(s, bool) else s.view for s in slots]
        return PutBatch(ns, targets, slots,
                        (lambda: self.held.give(tenant, held, put=True)) if held else None)

    def _put_scope(self, session: Session, ns_id: bytes, keys: Sequence[bytes],
                   payload_len: int) -> tuple[Namespace, list[bytes]]:
        ns = session.namespaces.get(ns_id)
        if ns is None:
            raise _unknown(ns_id)
        if payload_len != len(keys) * ns.chunk_bytes:
            raise ProtocolError(f"PUT payload of {payload_len} bytes is not {len(keys)} "
                                f"chunks of {ns.chunk_bytes}")
        scoped = scoped_chunk_keys(ns_id, keys)
        if self.catalog is not None:
            self.catalog.note(ns, keys, scoped)
        return ns, scoped

    def _reserve(self, ns: Namespace, scoped: list[bytes],
                 room: int) -> list[ChunkReservation | bool]:
        """Slots for the chunks of ``scoped`` not stored yet, at most ``room`` of them (the
        rest: False, dropped, counted as held_dropped_chunks); True for a stored one, False
        for one that found no slot (after waiting for pinned ones)."""
        pool = self.pool
        slots: list[ChunkReservation | bool] = []
        reserved = start = 0
        while start < len(scoped) and reserved < room:
            # Chunks already stored take no slot: ask for as many as the room left, again
            # until it is used (one round when everything fits).
            part = scoped[start:start + room - reserved]
            tried = pool.reserve_many(ns, part, wait=True)
            for slot in tried:
                if isinstance(slot, ChunkReservation):
                    reserved += 1
                    slots.append(slot)
                else:
                    slots.append(bool(slot))
            start += len(part)
        if start < len(scoped):
            self.counters.add("held_dropped_chunks", len(scoped) - start)
            slots.extend([False] * (len(scoped) - start))
        return slots

    def commit_put(self, batch: PutBatch) -> int:
        """Publish a PUT whose targets are all filled. Returns how many chunks count as
        stored (already-stored ones included). A durable put is written and synced first
        (acknowledged = on the SSD and synced: one write and sync for the batch); a
        non-durable one copies into the SSD's write-behind staging. Either delays only the
        caller's connection."""
        received = [s for s in batch._slots if not isinstance(s, bool)]
        stored = sum(s for s in batch._slots if isinstance(s, bool))
        try:
            stored += self.pool.commit_many(received)
        finally:
            batch.release()  # published (or given up): the slots are no longer held
        ns = batch.ns
        self.counters.add("put_chunks", stored)
        self._count_tenant(ns, requests=1, put_chunks=stored, put_bytes=stored * ns.chunk_bytes)
        return stored

    def delete(self, session: Session, ns_id: bytes, keys: Sequence[bytes]) -> int:
        """DELETE: how many of ``keys`` some tier held (removed from every tier)."""
        ns, scoped = self._scoped(session, ns_id, keys)
        return sum(self.pool.delete(ns, k) for k in scoped)

    def invalidate(self, session: Session, ns_id: bytes) -> int:
        """INVALIDATE: drop every chunk of a namespace; the copies dropped. It need not be
        declared here (``kvpool admin invalidate`` names an id): the admin token (or auth off)
        may drop any id, a tenant token its tenants' namespaces the registry knows; anything
        else raises Refused(FORBIDDEN)."""
        ns = session.namespaces.get(ns_id) or self.namespaces.find(ns_id)
        if self.auth.enabled and not session.admin and ns_id not in session.namespaces \
                and (ns is None or ns.tenant not in (session.tenants or ())):
            raise Refused(Status.FORBIDDEN, f"namespace {ns_id.hex()} is not known here as one "
                          "of this token's tenants' (the admin token may drop any id)")
        if ns is not None:
            self._count_tenant(ns, requests=1)
        return self.pool.invalidate(ns or ns_id)

    # ------------------------------------------------------------------ reads
    def exists_prefix(self, session: Session, ns_id: bytes, keys: Sequence[bytes]) -> int:
        """EXISTS_PREFIX: the length of the leading run of ``keys`` stored (index lookups
        under the tiers' locks, which are never held across IO)."""
        ns, scoped = self._scoped(session, ns_id, keys)
        return self.pool.lookup(ns, scoped)

    def exists(self, session: Session, ns_id: bytes, keys: Sequence[bytes]) -> list[bool]:
        """EXISTS: one flag per key (see exists_prefix)."""
        ns, scoped = self._scoped(session, ns_id, keys)
        return self.pool.held_many(ns, scoped)

    def touch(self, session: Session, ns_id: bytes, keys: Sequence[bytes]) -> int:
        """TOUCH: count ``keys`` as read; how many a tier holds. In-memory and never waits
        (pool.touch)."""
        ns, scoped = self._scoped(session, ns_id, keys)
        return self.pool.touch(ns, scoped)

    def get(self, session: Session, ns_id: bytes, keys: Sequence[bytes],
            touch: Sequence[bytes] = ()) -> GetAnswer:
        """GET ``keys`` (touching ``touch`` first, as TOUCH does): DRAM's chunks pinned, the
        rest a lower tier holds read into per-request buffers (blocking IO on the caller's
        thread). Raises Refused(TOO_LARGE) when the answer would exceed
        server.max_inflight_bytes, Refused(BUSY) past the node's held-bytes limits.

        The common case, every key in DRAM, is one call of the pool (``pin_resident``: one
        DRAM lock acquisition, no per-key objects); its counts (hits, policy recency, the
        pool's and the node's counters, latency) are made by ``GetAnswer.release``, after
        the transport sent the bytes, so they are not on the answer's path."""
        ns = self._namespace_of(session, ns_id)
        scoped = scoped_chunk_keys(ns_id, keys)
        if touch:
            self.pool.touch(ns, scoped_chunk_keys(ns_id, touch))
        if len(keys) * ns.chunk_bytes > self.cfg.max_inflight_bytes:
            raise Refused(Status.TOO_LARGE, f"{len(keys)} chunks of {ns.chunk_bytes} bytes "
                          f"exceed max_inflight_bytes {self.cfg.max_inflight_bytes}; "
                          "split the batch")
        pins = self.pool.pin_resident(ns, scoped)
        if pins is not None and pins.pinned == len(scoped):  # all from DRAM
            n = len(scoped)
            return GetAnswer(b"\x01" * n, pins.views, pins,  # type: ignore[arg-type]
                             lambda: self._count_get(ns, n, 0))
        return self._answer_get(ns, scoped, pins)

    def _count_get(self, ns: Namespace, hits: int, misses: int) -> None:
        self.counters.add_many({"get_hits": hits, "get_misses": misses})
        self._count_tenant(ns, get_hits=hits, get_misses=misses, get_bytes=hits * ns.chunk_bytes)

    def _answer_get(self, ns: Namespace, scoped: list[bytes],
                    pins: PinnedBatch | None) -> GetAnswer:
        """The answer over ``pins`` (None: no DRAM): of the chunks DRAM lacked, those a lower
        tier holds (an in-memory index probe first: a key held nowhere costs no buffer) are
        read into per-request buffers (blocking IO when there are any), whose bytes the
        node's ledger holds until ``release``. Raises Refused(BUSY) when they do not fit the
        ledger (held.py). Releases the pins if it raises."""
        held = 0
        tenant = ns.tenant
        try:
            payload: list[memoryview | None] = list(pins.views) if pins is not None \
                else [None] * len(scoped)
            missing = [i for i, p in enumerate(payload) if p is None]
            if missing:
                pool = self.pool
                stored = pool.held_many(ns, [scoped[i] for i in missing])
                to_read = [i for i, has in zip(missing, stored, strict=True) if has]
                if len(to_read) < len(missing):
                    pool.count_misses(ns, len(missing) - len(to_read))
                if to_read:
                    if not self.held.take(tenant, 1, len(to_read) * ns.chunk_bytes):
                        self.counters.add("held_refused")
                        raise Refused(Status.BUSY, f"GET refused: {self.held.describe(tenant)}")
                    held = len(to_read) * ns.chunk_bytes
                    bufs = [memoryview(bytearray(ns.chunk_bytes)) for _ in to_read]
                    found = pool.get_many_into(ns, [scoped[i] for i in to_read], bufs)
                    for i, buf, hit in zip(to_read, bufs, found, strict=True):
                        payload[i] = buf if hit else None
                    lost = found.count(False) * ns.chunk_bytes  # gone since the probe
                    self.held.give(tenant, lost)
                    held -= lost
        except BaseException:
            if pins is not None:
                pins.release()
            self.held.give(tenant, held)
            raise
        views = [p for p in payload if p is not None]
        hits, misses = len(views), len(scoped) - len(views)
        self._count_get(ns, hits, misses)
        flags = b"\x01" * hits if not misses else bytes(p is not None for p in payload)
        nbytes = held
        return GetAnswer(flags, views, pins,
                         (lambda: self.held.give(tenant, nbytes)) if nbytes else None)

    # ------------------------------------------------------------------ stats
    def _identity(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "version": __version__,
                "uptime_s": round(time.time() - self.started, 1),
                "gc_frozen_objects": gc.get_freeze_count()}

    def _tenant_table(self, tenants: frozenset[str]) -> dict[str, dict[str, int]]:
        connections: dict[str, int] = {}
        with self._sessions_lock:
            sessions = list(self._sessions)
        for session in sessions:
            for tenant in session.tenants or ():
                connections[tenant] = connections.get(tenant, 0) + 1
        return self.tenant_counts.snapshot(tenants, connections)

    def stats(self, session: Session, transport: dict[str, Any]) -> dict[str, Any]:
        """STATS as ``session`` may see them. With auth on, a tenant token gets the node's
        identity and its own tenants' counters and namespaces only; the admin token (and
        every connection when auth is off) gets the node's counters (``draining`` among
        them), ``transport``'s figures (connections, requests in flight), the registry's and
        its namespaces, every tier's and every tenant's."""
        if self.auth.enabled and not session.admin:
            mine = session.tenants or frozenset()
            quotas = {t: q for t, q in self.pool.quotas.stats().items() if t in mine}
            return {"server": self._identity(), "tenants": self._tenant_table(mine),
                    "namespaces": self.namespaces.listing(mine),
                    "retention": {"tenants": quotas}}
        server: dict[str, Any] = self.counters.snapshot()
        server.update(self._identity(), **transport, **self.namespaces.stats(),
                      draining=self.drained, held_bytes=self.held.held,
                      max_held_bytes=self.held.limit)
        out: dict[str, Any] = {"server": server, "namespaces": self.namespaces.listing(None)}
        if self.auth.enabled:
            out["tenants"] = self._tenant_table(self.auth.tenants)
        return {**out, **self.pool.stats()}
