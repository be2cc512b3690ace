"""KVPool: the embedded pool that composes DRAM and SSD behind one API (DESIGN.md sections 4-5).

Reads go DRAM -> write-behind staging -> SSD; an SSD hit is promoted to DRAM. Puts land in
DRAM; DRAM victims (or, with ``pool.ssd_write: through``, every put) are written to SSD by the
bounded write-behind queue, as the admission policy allows.

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

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvpool.buffers import byte_view
from kvpool.config import Config, load_config
from kvpool.counters import Counters
from kvpool.errors import ArgumentError, ChunkSizeError, PoolClosedError, UnknownNamespaceError
from kvpool.keys import KEY_BYTES, Namespace
from kvpool.policy import AdmissionPolicy, make_admission_policy
from kvpool.ssd.engine import SsdEngine
from kvpool.tiers.dram import DramTier, PinnedView, SlotReservation
from kvpool.tiers.remote import RemoteTier
from kvpool.writebehind import WriteBehind

log = logging.getLogger("kvpool.pool")
#: Prefetches queued at once; more are skipped (counted) rather than waited for.
PREFETCH_MAX_PENDING = 4
#: Chunks a prefetch reads per batch (its scratch memory is this many chunks).
PREFETCH_BATCH = 8


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
    (or the defaults) with ``KVPOOL_*`` overrides; pass a Config to be explicit."""

    def __init__(self, config: Config | None = None, remote: bool = True) -> None:
        if config is not None and not isinstance(config, Config):
            raise ArgumentError(f"config must be a kvpool Config (load_config() or "
                                f"config_from_dict({{...}})), got {type(config).__name__}")
        self.config = config if config is not None else load_config()
        cfg = self.config
        self._namespaces: dict[bytes, Namespace] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._counters = Counters(  # bumped by callers, the prefetch thread and IO threads
            "lookups", "lookup_hit_chunks", "dram_hits", "staged_hits", "ssd_hits",
            "remote_hits", "misses", "promotions", "prefetched", "prefetch_skipped",
            "durable_write_errors")
        self._prefetcher: ThreadPoolExecutor | None = None
        self._prefetch_pending = 0
        self._admission: AdmissionPolicy = make_admission_policy(cfg.ssd.admission,
                                                                 cfg.ssd.second_use_window)
        self._ssd: SsdEngine | None = None
        self._wb: WriteBehind | None = None
        self._dram: DramTier | None = None
        self._remote: RemoteTier | None = None
        if cfg.ssd.enabled:
            s = cfg.ssd
            self._ssd = SsdEngine(cfg.ssd_path(), s.capacity, s.segment_size, s.durability,
                                  s.io_threads, s.direct_io, s.eviction,
                                  s.copy_forward_fraction)
            self._wb = WriteBehind(self._ssd, cfg.pool.write_behind_bytes,
                                   cfg.pool.write_behind_batch)
        #: Every put goes to SSD (write-through, or no DRAM to hold it)...
        self._through = self._ssd is not None and (cfg.pool.ssd_write == "through"
                                                   or cfg.dram.capacity == 0)
        #: ...and, durable, is acknowledged only once synced (no write-behind in between).
        self.durable_puts = self._through and cfg.ssd.durability == "durable"
        if remote and cfg.cluster.enabled:
            try:
                self._remote = RemoteTier(cfg.cluster, cfg.pool.write_behind_batch)
            except BaseException:
                self._close_lower()
                raise
        if cfg.dram.capacity > 0:
            d = cfg.dram
            try:
                self._dram = DramTier(d.capacity, d.slab_size, d.eviction, d.shm_path,
                                      on_evict=self._demote, put_wait_s=d.put_wait_s,
                                      prefault=d.prefault)
            except BaseException:
                self._close_lower()
                raise

    # ------------------------------------------------------------------ namespaces
    def register_namespace(self, ns: Namespace) -> Namespace:
        """Make a namespace usable. Idempotent. Raises ValueError if its chunk cannot fit a
        DRAM slab or an SSD segment, AuthError if storage nodes refuse this client's token
        for its tenant, ArgumentError if ``ns`` is not a Namespace."""
        self._check_open()
        _check_namespace_type(ns)
        if self._dram is not None:
            self._dram.check_chunk_size(ns.chunk_bytes)
        if self._ssd is not None and ns.chunk_bytes > self._ssd.max_payload:
            raise ValueError(f"chunk of {ns.chunk_bytes} bytes does not fit ssd.segment_size="
                             f"{self._ssd.segment_size}")
        if self._remote is not None and ns.id not in self._namespaces:
            self._remote.register_namespace(ns)
        with self._lock:
            self._namespaces[ns.id] = ns
        return ns

    def unregister_namespace(self, ns: Namespace) -> None:
        """Forget a namespace (a storage node bounds its registry with this). Its chunks stay
        stored: once it is registered again they are served again; until then calls with it
        raise UnknownNamespaceError. Idempotent."""
        with self._lock:
            self._namespaces.pop(ns.id, None)

    def _registered(self, ns: Namespace) -> Namespace:
        self._check_open()
        _check_namespace_type(ns)
        if ns.id not in self._namespaces:
            raise UnknownNamespaceError(f"namespace {ns.id.hex()} ({ns.model!r}) is not "
                                        "registered; call register_namespace first")
        return ns

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("KVPool is closed")

    @staticmethod
    def _check_key(key: bytes, what: str = "key") -> None:
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            got = (f"{len(key)} bytes" if isinstance(key, bytes | bytearray | memoryview)
                   else type(key).__name__)
            raise ArgumentError(f"{what} must be a chunk key of {KEY_BYTES} bytes, "
                                f"got {got}")

    @classmethod
    def _check_keys(cls, keys: Sequence[bytes]) -> None:
        if isinstance(keys, bytes | bytearray | memoryview | str) or not isinstance(
                keys, Sequence):
            raise ArgumentError(f"keys must be a sequence of {KEY_BYTES}-byte chunk keys "
                                f"(e.g. ns.chunk_keys(tokens)), got {type(keys).__name__}")
        for i, key in enumerate(keys):
            if not isinstance(key, bytes) or len(key) != KEY_BYTES:
                cls._check_key(key, f"keys[{i}]")

    @staticmethod
    def _check_size(ns: Namespace, view: memoryview, what: str) -> None:
        if view.nbytes != ns.chunk_bytes:
            raise ChunkSizeError(f"{what} has {view.nbytes} bytes; namespace {ns.model!r} "
                                 f"chunks have {ns.chunk_bytes}")

    # ------------------------------------------------------------------ writes
    def _demote(self, key: bytes, ns: Namespace, payload: memoryview, hits: int,
                on_lower: bool) -> None:
        if self._wb is not None and not on_lower and self._admission.admit(key, hits):
            self._wb.offer(key, ns, payload)

    def put(self, ns: Namespace, key: bytes, data: Any) -> bool:
        """Store one chunk (idempotent: chunks are immutable). True if it is stored as the
        pool's durability promises (see the module docstring: on SSD and synced for durable
        puts, else held by a tier); False if it was dropped under overload or, for a durable
        put, the SSD write failed (counted; the chunk may still be served from DRAM)."""
        return self.put_many(ns, [key], [data]) == 1

    def put_many(self, ns: Namespace, keys: Sequence[bytes], datas: Sequence[Any]) -> int:
        """Store several chunks; returns how many were stored (as ``put`` counts them).
        Durable puts of one batch share one fdatasync per SSD segment they touch."""
        self._registered(ns)
        self._check_keys(keys)
        if len(keys) != len(datas):
            raise ArgumentError(f"keys ({len(keys)}) and datas ({len(datas)}) differ in length")
        views = [byte_view(d) for d in datas]
        for view in views:
            self._check_size(ns, view, "data")
        return self._store([(k, ns, v, None) for k, v in zip(keys, views, strict=True)])

    def _store(self, items: Sequence[tuple[bytes, Namespace, memoryview,
                                           SlotReservation | None]]) -> int:
        """The one write path of ``put_many`` and ``commit_many``: the SSD first (written and
        synced for durable puts, else offered to write-behind when writing through), then the
        cluster's write-behind, then DRAM (a filled slot is published, otherwise a copy is
        put). Returns how many count as stored: durable = synced; else held by any tier."""
        lower = [(k, ns, v) for k, ns, v, _ in items]
        if self.durable_puts:
            on_ssd = self._write_durable(lower)
        elif self._through and self._wb is not None:
            wb = self._wb
            on_ssd = [wb.offer(k, ns, v) for k, ns, v in lower]
        else:
            on_ssd = [False] * len(items)
        stored = 0
        for (key, ns, view, slot), staged in zip(items, on_ssd, strict=True):
            on_lower = staged  # a lower tier has it: a DRAM eviction needs no demotion
            if self._remote is not None:
                on_lower |= self._remote.offer(key, ns, view)
            held = on_lower
            if slot is not None:
                held = slot.commit() or on_lower
                if on_lower and self._dram is not None:
                    self._dram.mark_on_lower(key)
            elif self._dram is not None:
                held = self._dram.put(key, ns, view, on_lower=on_lower) or on_lower
            stored += staged if self.durable_puts else held
        return stored

    def _write_durable(self, items: Sequence[tuple[bytes, Namespace, memoryview]]) -> list[bool]:
        """Append the chunks the SSD does not hold yet and fdatasync (the engine is in
        durable mode). Per chunk: True once it is on the SSD and synced. An IO error (full or
        failing disk) is logged and counted; the chunks of the failed part are False."""
        assert self._ssd is not None
        ssd = self._ssd
        todo = [(k, ns, v) for k, ns, v in items if not ssd.contains(k, ns.id)]
        if todo:
            try:
                ssd.put_many(todo)
            except OSError as exc:
                # Sub-batches written before the failure are indexed (and synced): the
                # index, not the exception, says which chunks are durable.
                log.warning("durable put of %d chunks failed: %s", len(todo), exc)
                self._counters.add("durable_write_errors")
        return [ssd.contains(key, ns.id) for key, ns, _ in items]

    def reserve(self, ns: Namespace, key: bytes,
                wait: bool = True) -> ChunkReservation | bool | None:
        """Room for one chunk that the caller fills in place through ``.view`` (a storage
        node receives a PUT payload straight into a DRAM slot), then ``commit()`` (or
        ``commit_many``) or ``abort()``. Returns True instead when the chunk is already
        stored, False when it was dropped for lack of room (counted). With ``wait=False`` it
        never blocks and returns None where it would have waited for a pinned slot. Same
        checks as ``put``."""
        self._registered(ns)
        self._check_key(key)
        if self._dram is None:
            scratch = memoryview(bytearray(ns.chunk_bytes))
            return ChunkReservation(ns, key, scratch, None, self.commit_many)
        slot = self._dram.reserve(key, ns, ns.chunk_bytes, wait=wait)
        if slot is None or isinstance(slot, bool):
            return slot
        return ChunkReservation(ns, key, slot.view, slot, self.commit_many)

    def commit_many(self, reservations: Sequence[ChunkReservation]) -> int:
        """Publish filled reservations; returns how many are stored, counted as ``put_many``
        counts them. For durable puts this writes and syncs the records first (one sync per
        segment for the whole batch): call it where blocking on an fdatasync is fine, never
        on an event loop. Reservations already committed or aborted are skipped."""
        return self._store([(r.key, r.ns, r.view, r.slot)
                            for r in reservations if r.take()])

    # ------------------------------------------------------------------ reads
    def get_into(self, ns: Namespace, key: bytes, out: Any) -> bool:
        """Copy a chunk's payload into ``out`` (exactly ns.chunk_bytes, writable). False on a
        miss; on a miss the contents of ``out`` are unspecified."""
        return self.get_many_into(ns, [key], [out])[0]

    def get_many_into(self, ns: Namespace, keys: Sequence[bytes],
                      outs: Sequence[Any]) -> list[bool]:
        """Batched get_into: DRAM first, then staged writes, then parallel SSD reads (hits are
        promoted to DRAM)."""
        self._registered(ns)
        self._check_keys(keys)
        if len(keys) != len(outs):
            raise ArgumentError(f"keys ({len(keys)}) and outs ({len(outs)}) differ in length")
        views = [byte_view(o, writable=True) for o in outs]
        for view in views:
            self._check_size(ns, view, "output buffer")
        found = [False] * len(keys)
        pending: list[int] = []
        ns_id = ns.id  # every tier checks the namespace a chunk was stored under
        dram_hits = staged_hits = 0  # counted once per batch: each add takes a lock
        for i, (key, view) in enumerate(zip(keys, views, strict=True)):
            if self._dram is not None and self._dram.get_into(key, view, ns_id):
                found[i] = True
                dram_hits += 1
            elif (self._wb is not None and self._wb.get_into(key, view, ns_id)) or (
                    self._remote is not None and self._remote.staged_get_into(key, view,
                                                                              ns_id)):
                found[i] = True
                staged_hits += 1
            else:
                pending.append(i)
        self._counters.add("dram_hits", dram_hits)
        self._counters.add("staged_hits", staged_hits)
        if pending and self._ssd is not None:
            ssd = self._ssd
            pending = self._fetch(ns, keys, views, found, pending,
                                  lambda k, v: ssd.get_many_into(k, v, namespace_id=ns_id),
                                  "ssd_hits")
        if pending and self._remote is not None:
            remote = self._remote
            pending = self._fetch(ns, keys, views, found, pending,
                                  lambda k, v: remote.get_many_into(ns, k, v), "remote_hits")
        self._counters.add("misses", len(pending))
        return found

    def _fetch(self, ns: Namespace, keys: Sequence[bytes], views: list[memoryview],
               found: list[bool], pending: list[int],
               read: Callable[[list[bytes], list[memoryview]], list[bool]],
               counter: str) -> list[int]:
        """Read ``pending`` from a slower tier into their views; hits are promoted to DRAM.
        Returns the indices still missing."""
        got = read([keys[i] for i in pending], [views[i] for i in pending])
        still = []
        promotions = 0
        for i, hit in zip(pending, got, strict=True):
            if not hit:
                still.append(i)
                continue
            found[i] = True
            if self._dram is not None and self.config.pool.promote_on_hit:
                self._dram.put(keys[i], ns, views[i], on_lower=True)
                promotions += 1
        self._counters.add(counter, len(pending) - len(still))
        self._counters.add("promotions", promotions)
        return still

    def prefetch(self, ns: Namespace, keys: Sequence[bytes]) -> Future[int] | None:
        """Start copying the chunks that only slower tiers hold (SSD, storage nodes) up into
        DRAM, in the background, so a load that follows a lookup finds them there. Returns a
        future of how many were promoted, or None when there is nothing to do: no DRAM tier,
        everything already in DRAM, or PREFETCH_MAX_PENDING prefetches already queued (the
        request is skipped and counted, never waited for). Faults are misses, as in reads."""
        self._registered(ns)
        self._check_keys(keys)
        if self._dram is None or (self._ssd is None and self._remote is None):
            return None
        todo = [k for k in keys if not self._dram.contains(k, ns.id)]
        if not todo:
            return None
        with self._lock:
            if self._prefetch_pending >= PREFETCH_MAX_PENDING:
                self._counters.add("prefetch_skipped")
                return None
            self._prefetch_pending += 1
            if self._prefetcher is None:
                self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="kvpool-prefetch")
            return self._prefetcher.submit(self._prefetch_job, ns, todo)

    def _prefetch_job(self, ns: Namespace, keys: list[bytes]) -> int:
        promoted = 0
        try:
            bufs = [memoryview(bytearray(ns.chunk_bytes))
                    for _ in range(min(len(keys), PREFETCH_BATCH))]
            for start in range(0, len(keys), PREFETCH_BATCH):
                if self._closed:
                    break
                batch = keys[start:start + PREFETCH_BATCH]
                promoted += sum(self.get_many_into(ns, batch, bufs[:len(batch)]))
        except PoolClosedError:
            pass  # closing: the prefetch is moot
        except Exception:  # a read fault is a miss; a prefetch never surfaces errors
            log.exception("prefetch of %d chunks failed", len(keys))
        finally:
            with self._lock:
                self._prefetch_pending -= 1
                self._counters.add("prefetched", promoted)
        return promoted

    def pin_many(self, ns: Namespace, keys: Sequence[bytes]) -> list[PinnedView | None]:
        """Zero-copy, read-only views of the chunks resident in DRAM (None for the others,
        which get_many_into can still fetch). Each view pins its slot until ``release()``:
        release every one, or the slots can never be evicted. A key not pinned is not
        counted as a DRAM miss here: the get_many_into that fetches it counts it, so one
        read of a chunk counts at most one DRAM miss."""
        self._registered(ns)
        self._check_keys(keys)
        if self._dram is None:
            return [None] * len(keys)
        views = [self._dram.view(key, ns.id, count_miss=False) for key in keys]
        self._counters.add("dram_hits", sum(v is not None for v in views))
        return views

    def _held_locally(self, ns_id: bytes, keys: Sequence[bytes],
                      stop_at_miss: bool) -> list[bool]:
        """Per key: does a local tier (or the cluster's save queue) hold it? Each tier is
        asked once for the keys the faster ones lack. ``stop_at_miss``: only the leading run
        matters (a lookup), so the answer is cut at the first key no tier holds. Probing a
        batch costs one lock per tier instead of one per key and tier."""
        held = [False] * len(keys)
        todo = list(range(len(keys)))
        probes: list[Callable[[Sequence[bytes], bytes], list[bool]]] = []
        if self._dram is not None:
            probes.append(self._dram.contains_many)
        if self._wb is not None:
            probes.append(self._wb.contains_many)
        if self._ssd is not None:
            probes.append(self._ssd.contains_many)
        if self._remote is not None:
            probes.append(self._remote.staged_many)
        for probe in probes:
            if not todo:
                break
            flags = probe([keys[i] for i in todo], ns_id)
            missing = []
            for i, flag in zip(todo, flags, strict=True):
                if flag:
                    held[i] = True
                else:
                    missing.append(i)
            todo = missing
        if stop_at_miss and todo:
            return held[:todo[0]]
        return held

    def lookup(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        """Length of the longest leading run of ``keys`` present in any tier: the local
        tiers first (each asked once, for what the faster ones lack), then, for the rest,
        one batched EXISTS per storage node."""
        self._registered(ns)
        self._check_keys(keys)
        self._counters.add("lookups")
        n = len(self._held_locally(ns.id, keys, stop_at_miss=True))
        if n < len(keys) and self._remote is not None:
            n += self._remote.lookup(ns, keys[n:])
        self._counters.add("lookup_hit_chunks", n)
        return n

    def contains(self, ns: Namespace, key: bytes) -> bool:
        """True if any local tier (or the cluster's save queue) holds the chunk."""
        self._check_key(key)
        return self.contains_many(ns, [key])[0]

    def contains_many(self, ns: Namespace, keys: Sequence[bytes]) -> list[bool]:
        """``contains`` per key, each local tier asked once for the batch."""
        self._registered(ns)
        self._check_keys(keys)
        return self._held_locally(ns.id, keys, stop_at_miss=False)

    # ------------------------------------------------------------------ removal
    def delete(self, ns: Namespace, key: bytes) -> bool:
        """Remove a chunk from every tier; True if any tier held it."""
        self._registered(ns)
        self._check_key(key)
        removed = False
        if self._dram is not None:
            removed |= self._dram.delete(key)
        if self._wb is not None:
            removed |= self._wb.contains(key)
            self._wb.discard(key)
            self._wb.flush()  # a chunk already being written must land before its tombstone
        if self._ssd is not None:
            removed |= self._ssd.delete(key)
        if self._remote is not None:
            removed |= self._remote.delete(ns, key)
        return removed

    def invalidate(self, ns: Namespace | bytes) -> int:
        """Drop every chunk of a namespace in every tier (persisted on SSD). Accepts a
        Namespace or a 16-byte namespace id, registered or not. Returns the copies dropped,
        summed over tiers (a chunk held in DRAM and on SSD counts twice)."""
        self._check_open()
        ns_id = ns.id if isinstance(ns, Namespace) else bytes(ns)
        dropped = 0
        if self._dram is not None:
            dropped += self._dram.invalidate(ns_id)
        if self._wb is not None:
            self._wb.discard_namespace(ns_id)
            self._wb.flush()
        if self._ssd is not None:
            dropped += self._ssd.invalidate(ns_id)
        if self._remote is not None:
            known = ns if isinstance(ns, Namespace) else self._namespaces.get(ns_id)
            if known is not None:  # nodes need the namespace itself (its tenant is checked)
                dropped += self._remote.invalidate(known)
        return dropped

    # ------------------------------------------------------------------ admin
    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the write-behind queues (SSD, cluster) to drain; False on timeout."""
        self._check_open()
        ok = self._wb.flush(timeout) if self._wb is not None else True
        return (self._remote.flush(timeout) if self._remote is not None else True) and ok

    def stats(self) -> dict[str, Any]:
        """Counters per tier: hits, misses, evictions, checksum failures, dropped saves..."""
        self._check_open()
        out: dict[str, Any] = {"pool": self._counters.snapshot()}
        if self._dram is not None:
            out["dram"] = self._dram.stats()
        if self._wb is not None:
            out["write_behind"] = self._wb.stats()
        if self._ssd is not None:
            out["ssd"] = self._ssd.stats()
        if self._remote is not None:
            out["remote"] = self._remote.stats()
        return out

    def _close_lower(self) -> None:
        if self._remote is not None:
            self._remote.close()
        if self._wb is not None:
            self._wb.close()
        if self._ssd is not None:
            self._ssd.close()

    def close(self) -> None:
        """Write staged chunks to SSD, then release every tier. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True)
        if self._dram is not None:
            self._dram.close()
        self._close_lower()

    def __enter__(self) -> KVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def touch(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        """Count ``keys`` as just read, without moving bytes: the DRAM eviction policy sees a
        hit and the SSD index marks them hot (copied forward when their segment is evicted).
        A storage node does this for its replica copies that another replica served, on its
        event loop: the DRAM lock is held as briefly as by ``contains``, and the SSD index is
        skipped (counted as ssd touch_skipped) while another thread holds its lock. Returns
        how many keys a tier touched; keys held nowhere are ignored. Same checks as lookup."""
        self._registered(ns)
        self._check_keys(keys)
        touched = 0
        for key in keys:
            held = self._dram is not None and self._dram.touch(key)
            if self._ssd is not None:
                held = self._ssd.touch(key) or held
            touched += held
        return touched


def _check_namespace_type(ns: object) -> None:
    if not isinstance(ns, Namespace):
        raise ArgumentError(f"ns must be a kvpool Namespace (register_namespace(Namespace("
                            f"...))), got {type(ns).__name__}")
