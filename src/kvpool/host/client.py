"""AttachedPool: the KVPool API of an engine process attached to its host's pool.

The engine maps the host pool's DRAM arena (its tenant's) and asks over the Unix socket,
one request per batch, for what only the host pool may decide: lookups, pins, reservations,
commits. The bytes never cross the socket on the common paths: a read pins the chunks and
copies them from the mapped arena into the caller's buffers (one copy), a write reserves
slots and copies the caller's data straight into them (one copy) before the commit
publishes them. Only chunks that find no DRAM slot on the host (everything pinned) travel in
the frame (``get``/``put`` fallbacks).

Failure contract, beside KVPool's (misuse raises the same errors): a host pool that is not
there, died, or is silent past ``host.request_timeout_s`` is a miss for every read, a
dropped save for every write (counted in ``stats()["attached"]``), never an exception or a
wait beyond that timeout; the pool attaches again on a call at least ``host.retry_s`` after
the last try, and registers its namespaces again. Pins and reservations of a lost
connection are void (the host pool released them); a view pinned before stays readable (the
mapping lives while it is held) until released. A refused attach (uid, token, tenant) raises
AttachError from the constructor, and is logged and retried later on a re-attach.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
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
from kvpool.host import wire
from kvpool.host.link import AttachError, Detached, Link
from kvpool.keys import Namespace
from kvpool.retention import Retention
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

log = logging.getLogger("kvpool.host")


class AttachedView:
    """A pinned, read-only view of a slot of the mapped arena (as PinnedView): the host pool
    keeps the slot until ``release()``; release every one."""

    __slots__ = ("_id", "_link", "_released", "data")

    def __init__(self, link: Link, pin: int, data: memoryview) -> None:
        self._link, self._id, self.data = link, pin, data
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.data.release()
            self._link.unpin_later([self._id])

    def __enter__(self) -> AttachedView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


class AttachedReservation:
    """Room for one chunk, filled in place through ``view`` (a slot of the mapped arena, or
    a scratch buffer sent with the commit when the host found no slot); as
    ChunkReservation: ``commit()`` or ``abort()``, the first wins."""

    __slots__ = ("_done", "_id", "_link", "_pool", "_scratch", "key", "ns", "view")

    def __init__(self, pool: AttachedPool, link: Link, rid: int, ns: Namespace, key: bytes,
                 view: memoryview, scratch: bool) -> None:
        self._pool, self._link, self._id = pool, link, rid
        self.ns, self.key, self.view, self._scratch = ns, key, view, scratch
        self._done = False

    def take(self) -> bool:
        if self._done:
            return False
        self._done = True
        return True

    def commit(self) -> bool:
        return True if self._done else self._pool.commit_many([self]) == 1

    def abort(self) -> None:
        if self.take():
            self._link.send({"op": wire.ABORT, "ids": [self._id]})


class AttachedPool:
    """The pool of an engine attached to ``config.host.socket``. Attaches at once (a host
    pool that is not there yet is not an error: misses until it is; one that refuses raises
    AttachError)."""

    def __init__(self, config: Config | None = None) -> None:
        self.config = config if config is not None else load_config()
        host = self.config.host
        if not host.socket:
            raise ArgumentError("host.socket is not set: use KVPool for an embedded pool")
        self._token = host.token if host.token is not None else self.config.cluster.token
        self._namespaces: dict[bytes, Namespace] = {}
        self._lock = threading.Lock()
        self._link_now: Link | None = None
        self._next_try = 0.0
        self._closed = False
        self._counters = Counters("attaches", "detaches", "detached_misses",
                                  "detached_drops", "misses", "dram_hits", "fallback_hits",
                                  "direct_hits", "direct_changed")
        self.metrics = CollectorRegistry(auto_describe=False)
        self.metrics_url: str | None = None
        pool = self.config.pool
        #: This engine's saves: its budget, its committer, its read-your-writes (the host
        #: pool marks a save's chunks from their reservation on, for every engine).
        self._saves = SavePipeline(
            lambda r: self.commit_many(cast("list[AttachedReservation]", r)),
            self._run_deferred, pool.save_budget_bytes, pool.save_commit_wait_s,
            pool.background_nice)
        self._link(raise_refused=True)

    # ------------------------------------------------------------------ the link
    @property
    def attached(self) -> bool:
        link = self._link_now
        return link is not None and not link.closed

    @property
    def durable_puts(self) -> bool:
        link = self._link_now
        return link is not None and link.durable

    def _link(self, raise_refused: bool = False) -> Link | None:
        """The live link, attaching when it is time to try again; None while detached."""
        with self._lock:
            if self._closed:
                raise PoolClosedError("KVPool is closed")
            link = self._link_now
            if link is not None and not link.closed:
                return link
            if link is not None:
                self._link_now = None
                self._counters.add("detaches")
                log.warning("detached from the host pool at %s", self.config.host.socket,
                            extra={"event": "host_detached"})
            now = time.monotonic()
            if now < self._next_try:
                return None
            self._next_try = now + self.config.host.retry_s
            try:
                link = Link(self.config.host, self._token)
            except Detached:
                return None
            except AttachError:
                if raise_refused:
                    raise
                log.warning("the host pool refused the attach", exc_info=True)
                return None
            try:
                for ns in list(self._namespaces.values()):
                    link.call({"op": wire.NAMESPACE, "spec": ns.canonical()})
            except Detached:
                return None
            except ArgumentError as exc:  # refused now: a setting changed on the host
                log.warning("%s", exc)
            self._link_now = link
            self._counters.add("attaches")
            return link

    def _miss(self, n: int, what: str = "detached_misses") -> None:
        if n:
            self._counters.add(what, n)

    # ------------------------------------------------------------------ namespaces
    def register_namespace(self, ns: Namespace) -> Namespace:
        """As KVPool's; raises ArgumentError when the host pool refuses it (a namespace of
        another tenant, a chunk its arena cannot hold). While detached it is registered
        with the host pool on the next attach."""
        self._check_open()
        check_namespace_type(ns)
        link = self._link()
        if link is not None:
            with contextlib.suppress(Detached):
                link.call({"op": wire.NAMESPACE, "spec": ns.canonical()})
        self._namespaces[ns.id] = ns
        return ns

    def unregister_namespace(self, ns: Namespace) -> None:
        self._namespaces.pop(ns.id, None)

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("KVPool is closed")

    def _registered(self, ns: Namespace, keys: Sequence[bytes] | object = NO_KEYS) -> Namespace:
        """``check_registered`` against this pool (as KVPool's)."""
        return check_registered(self._closed, self._namespaces, ns, keys)

    def _ask(self, op: str, ns: Namespace, keys: Sequence[bytes],
             **extra: Any) -> tuple[Link, dict[str, Any], bytearray] | None:
        """One batched request about ``keys``; None while detached."""
        link = self._link()
        if link is None:
            return None
        try:
            meta, payload = link.call({"op": op, "ns": ns.id.hex(), "n": len(keys), **extra},
                                      wire.pack_keys(keys))
        except Detached:
            return None
        return link, meta, payload

    # ------------------------------------------------------------------ writes
    def put(self, ns: Namespace, key: bytes, data: Any) -> bool:
        return self.put_many(ns, [key], [data]) == 1

    def put_many(self, ns: Namespace, keys: Sequence[bytes], datas: Sequence[Any]) -> int:
        """Reserve slots on the host, copy ``datas`` into them, commit: one copy, two round
        trips. Counted as KVPool.put_many counts; a detached pool drops them (0)."""
        self._registered(ns, keys)
        check_same_length(keys, datas, "datas")
        views = [byte_view(d) for d in datas]
        for view in views:
            check_size(ns, view, "data")
        stored, filled = 0, []
        for r, view in zip(self.reserve_many(ns, keys), views, strict=True):
            if isinstance(r, AttachedReservation):
                r.view[:] = view
                filled.append(r)
            else:
                stored += bool(r)
        return stored + (self.commit_many(filled) if filled else 0)

    def reserve(self, ns: Namespace, key: bytes,
                wait: bool = True) -> AttachedReservation | bool | None:
        check_key(key)
        return self.reserve_many(ns, [key], wait)[0]

    def reserve_many(self, ns: Namespace, keys: Sequence[bytes],
                     wait: bool = True) -> list[AttachedReservation | bool | None]:
        """As KVPool's (True: already stored; False: dropped). The host pool may wait for a
        slot up to its dram.put_wait_s whatever ``wait`` says. Detached: all False."""
        self._registered(ns, keys)
        return self._reserve(ns, keys, wait)

    def _reserve(self, ns: Namespace, keys: Sequence[bytes], wait: bool,
                 save: bool = False) -> list[AttachedReservation | bool | None]:
        """``reserve_many`` after its checks; ``save``: the host pool counts the chunks as
        being saved (every engine's lookups count them, reads wait for their commit) until
        they are committed or aborted."""
        asked = self._ask(wire.RESERVE, ns, keys, wait=wait, save=save)
        if asked is None:
            self._miss(len(keys), "detached_drops")
            return [False] * len(keys)
        link, meta, _ = asked
        size = ns.chunk_bytes
        out: list[AttachedReservation | bool | None] = []
        for key, r in zip(keys, meta["res"], strict=True):
            if isinstance(r, list):
                rid, offset = r
                scratch = offset < 0
                view = memoryview(bytearray(size)) if scratch else link.view(offset, size)
                out.append(AttachedReservation(self, link, rid, ns, key, view, scratch))
            else:
                out.append(bool(r))
        return out

    def commit_many(self, reservations: Sequence[AttachedReservation]) -> int:
        """Publish filled reservations (one request per connection they were made on);
        those of a lost connection count as dropped."""
        taken = [r for r in reservations if r.take()]
        stored = 0
        by_link: dict[int, list[AttachedReservation]] = {}
        for r in taken:
            by_link.setdefault(id(r._link), []).append(r)
        for group in by_link.values():
            link = group[0]._link
            puts: list[tuple[dict[str, Any], wire.Bytes]] = [
                ({"op": wire.PUT, "id": r._id}, r.view) for r in group if r._scratch]
            try:
                meta, _ = link.call({"op": wire.COMMIT, "ids": [r._id for r in group]},
                                    parts=puts)
            except Detached:
                self._miss(len(group), "detached_drops")
                continue
            stored += int(meta["n"])
        return stored

    # ------------------------------------------------------------------ save / load
    def retain(self, ns: Namespace, keys: Sequence[bytes],
               retention: Retention | None) -> None:
        """Record ``retention`` for ``keys`` in the host pool (as KVPool.retain: raises
        PinLimitError for pins past the host's bound); nothing to do for None. Detached:
        nothing recorded (the save that follows is dropped anyway)."""
        if retention is None:
            return
        self._registered(ns, keys)
        self._ask(wire.RETAIN, ns, keys, retention=retention.to_mapping())

    def release(self, session: str, delete: bool = False) -> int:
        """As KVPool.release, in the host pool (this engine's tenant); 0 while detached."""
        self._check_open()
        if not isinstance(session, str) or not session:
            raise ArgumentError(f"session must be a non-empty string, got {session!r}")
        link = self._link()
        if link is None:
            return 0
        try:
            meta, _ = link.call({"op": wire.RELEASE, "session": session, "delete": delete})
        except Detached:
            return 0
        return int(meta["n"])

    def saving_many(self, ns: Namespace, keys: Sequence[bytes]) -> list[bool]:
        """Per key: is this engine saving it (handed to its committer, not yet published)?"""
        self._registered(ns, keys)
        return self._saves.saving(ns.id, keys)

    def begin_save(self, ns: Namespace, keys: Sequence[bytes],
                   retention: Retention | None = None) -> SaveBatch:
        """As KVPool.begin_save: slots of the host's arena, reserved without waiting,
        filled in place through the mapping, committed by this engine's committer (one
        request per batch). One difference: the host pool counts the chunks as being saved
        from their reservation on (not from ``commit()``), so every engine's lookups see
        them once this returns and their reads wait for the commit (at most
        ``pool.save_commit_wait_s``); an abort, or this engine's death, ends that. Detached:
        every chunk is a counted drop (``save_dropped_no_slot`` and ``detached_drops``)."""
        self._registered(ns, keys)
        self.retain(ns, keys, retention)
        return pipeline.begin_save(self, self._saves, ns, list(keys))

    def save(self, ns: Namespace, keys: Sequence[bytes], fill: Fill, *,
             defer: bool = False, retention: Retention | None = None) -> SaveTicket:
        """As KVPool.save (same ticket, same ``defer``, same faults)."""
        self._registered(ns, keys)
        self.retain(ns, keys, retention)
        if not defer:
            return pipeline.save_inline(self, self._saves, ns, list(keys), fill)
        ticket = SaveTicket(keys, 0)
        self._saves.defer(_Deferred(ns, list(keys), fill, ticket))
        return ticket

    def _run_deferred(self, job: _Deferred) -> int:
        return pipeline.run_deferred(self, self._saves, job, self._closed)

    def reserve_for_save(self, ns: Namespace, keys: Sequence[bytes],
                         saving: bool) -> list[AttachedReservation | bool | None]:
        """The save pipeline's reservation (``saves.SaveSide``): chunks this engine is
        saving count as stored (with ``saving``), the host is asked for the rest."""
        local = self._saves.saving(ns.id, keys) if saving else [False] * len(keys)
        todo = [i for i, flag in enumerate(local) if not flag]
        out: list[AttachedReservation | bool | None] = [True] * len(keys)
        if todo:
            got = self._reserve(ns, [keys[i] for i in todo], False, save=True)
            for i, r in zip(todo, got, strict=True):
                out[i] = r
        return out

    def open_load(self, ns: Namespace, keys: Sequence[bytes]) -> LoadHandle:
        """As KVPool.open_load: this engine's saves of ``keys`` are waited for (the host
        pool waits for other engines'), the chunks are pinned in the host's arena (fetched
        from its lower tiers first) and read in place through the mapping. Detached: all
        misses (``loaded`` 0)."""
        self._registered(ns, keys)
        return pipeline.open_load(self, self._saves, ns, list(keys))

    def load(self, ns: Namespace, keys: Sequence[bytes], scatter: Scatter) -> int:
        """As KVPool.load: ``scatter(i, view)`` over the leading run, straight from the
        mapped arena; returns the run's length."""
        return pipeline.load(self.open_load(ns, keys), scatter)

    def pin_for_load(self, ns: Namespace, keys: Sequence[bytes]) -> list[Pinned | None]:
        return list(self._pin_many(ns, keys, True))

    def read_for_load(self, ns: Namespace, keys: Sequence[bytes],
                      views: list[memoryview]) -> list[bool]:
        return self._get_many_into(ns, keys, views)

    # ------------------------------------------------------------------ reads
    def get_into(self, ns: Namespace, key: bytes, out: Any) -> bool:
        return self.get_many_into(ns, [key], [out])[0]

    def get_many_into(self, ns: Namespace, keys: Sequence[bytes],
                      outs: Sequence[Any]) -> list[bool]:
        """Copy the chunks the host's DRAM holds from the mapped arena into ``outs``, found
        through the host pool's read directory (no round trip; ``host.direct_reads``); for
        the others, pin on the host (reading SSD or node hits into free host slots first),
        copy, unpin: one round trip. One copy per chunk either way."""
        self._registered(ns, keys)
        check_same_length(keys, outs, "outs")
        views = [byte_view(o, writable=True) for o in outs]
        for view in views:
            check_size(ns, view, "output buffer")
        self._saves.wait_committed(ns.id, keys)
        return self._get_many_into(ns, keys, views)

    def _get_many_into(self, ns: Namespace, keys: Sequence[bytes],
                       views: Sequence[memoryview]) -> list[bool]:
        """``get_many_into`` after its checks and its wait for this engine's commits: the
        directory's hits, then one request for the rest."""
        link = self._link()
        if link is None:
            self._miss(len(keys))
            return [False] * len(keys)
        found = self._read_direct(link, ns, keys, views) \
            if link.directory is not None and link.alive() else None
        if found is None:
            return self._read_via_host(ns, keys, views)
        rest = [i for i, hit in enumerate(found) if not hit]
        if rest:
            got = self._read_via_host(ns, [keys[i] for i in rest], [views[i] for i in rest])
            for i, hit in zip(rest, got, strict=True):
                found[i] = hit
        return found

    def _read_direct(self, link: Link, ns: Namespace, keys: Sequence[bytes],
                     views: Sequence[memoryview]) -> list[bool] | None:
        """Copy what the read directory says DRAM holds (tiers/directory.py: a copy counts
        only if its entry did not change meanwhile); per key, was it read. None when
        nothing was (ask the host pool for all). The host pool hears of the reads later
        (``Link.reads_later``), to count them and keep them in its eviction's recency."""
        directory = link.directory
        assert directory is not None
        size = ns.chunk_bytes
        at, offsets, entries, seqs = directory.find(keys, ns.id, size, link.arena_bytes)
        if not at:
            return None
        arena = link.arena
        try:
            for i, offset in zip(at, offsets, strict=True):
                views[i][:] = arena[offset:offset + size]
        except ValueError:  # the link closed under this read (the arena went)
            if not link.closed:
                raise
            return None
        changed = directory.changed(entries, seqs)
        if changed:  # their slots changed hands during the copy: asked for instead
            dropped = {at[j] for j in changed}
            at = [i for i in at if i not in dropped]
        found = [False] * len(keys)
        for i in at:  # a key may be listed twice (found in two ways during a move)
            found[i] = True
        read = keys if all(found) else [k for k, hit in zip(keys, found, strict=True) if hit]
        if read:
            link.reads_later(ns.id.hex(), read)
        self._counters.add_many({"dram_hits": len(read), "direct_hits": len(read),
                                 "direct_changed": len(changed)})
        return found

    def _read_via_host(self, ns: Namespace, keys: Sequence[bytes],
                       views: Sequence[memoryview]) -> list[bool]:
        """Pin on the host (fetching), copy from the arena, unpin: one round trip."""
        n = len(keys)
        asked = self._ask(wire.PIN, ns, keys, fetch=True, read=True, batch=True)
        if asked is None:
            self._miss(n)
            return [False] * n
        link, _, payload = asked
        size = ns.chunk_bytes
        found = [False] * n
        pairs = wire.unpack_pins(payload, n)
        arena = link.arena
        pins: dict[int, None] = {}
        pos = n * wire.PAIR_BYTES  # the carried chunks follow the pairs
        carried = 0
        try:
            for i in range(n):
                offset = pairs[2 * i + 1]
                if offset >= 0:
                    pins[pairs[2 * i]] = None
                    views[i][:] = arena[offset:offset + size]
                    found[i] = True
                elif offset == wire.IN_TAIL:
                    views[i][:] = payload[pos:pos + size]
                    pos += size
                    carried += 1
                    found[i] = True
        except ValueError:  # the link closed under this read (the arena went), or a bad
            if not link.closed:  # offset that a host pool never sends
                raise
            self._miss(n)
            return [False] * n
        finally:
            if pins:  # one id per batch (``batch``), repeated for each of its chunks
                link.unpin_later(list(pins))
        hits = sum(found)
        self._counters.add_many({"dram_hits": hits - carried, "fallback_hits": carried,
                                 "misses": n - hits})
        return found

    def pin_many(self, ns: Namespace, keys: Sequence[bytes],
                 fetch: bool = False) -> list[AttachedView | None]:
        """Zero-copy read-only views of the chunks the host's DRAM holds (``fetch``: lower
        tiers' chunks read into free host slots first); None for the others, and for all
        while detached. Release every view. This engine's saves of ``keys`` are waited for
        first (``pool.save_commit_wait_s``)."""
        self._registered(ns, keys)
        self._saves.wait_committed(ns.id, keys)
        return self._pin_many(ns, keys, fetch)

    def _pin_many(self, ns: Namespace, keys: Sequence[bytes],
                  fetch: bool) -> list[AttachedView | None]:
        asked = self._ask(wire.PIN, ns, keys, fetch=fetch)
        if asked is None:
            self._miss(len(keys))
            return [None] * len(keys)
        link, _, payload = asked
        size, pairs = ns.chunk_bytes, wire.unpack_pins(payload, len(keys))
        return [AttachedView(link, pin, link.view(offset, size).toreadonly())
                if offset >= 0 else None
                for pin, offset in zip(pairs[::2], pairs[1::2], strict=True)]

    def prefetch(self, ns: Namespace, keys: Sequence[bytes]) -> Future[int] | None:
        """Ask the host pool to move the leading run of ``keys`` up into its DRAM (its
        lookup with read-ahead); returns None (nothing to wait for here)."""
        self.lookup(ns, keys, prefetch=len(keys))
        return None

    def lookup(self, ns: Namespace, keys: Sequence[bytes], *, prefetch: int = 0) -> int:
        """The host pool's lookup (its read-ahead with ``prefetch``); 0 while detached."""
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0 chunks, got {prefetch}")
        self._registered(ns, keys)
        asked = self._ask(wire.LOOKUP, ns, keys, prefetch=prefetch)
        return 0 if asked is None else int(asked[1]["n"])

    def contains(self, ns: Namespace, key: bytes) -> bool:
        check_key(key)
        return self.contains_many(ns, [key])[0]

    def contains_many(self, ns: Namespace, keys: Sequence[bytes]) -> list[bool]:
        self._registered(ns, keys)
        asked = self._ask(wire.CONTAINS, ns, keys)
        return [False] * len(keys) if asked is None else [bool(f) for f in asked[1]["flags"]]

    def count_misses(self, ns: Namespace, n: int) -> None:
        self._miss(max(n, 0), "misses")

    def touch(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        self._registered(ns, keys)
        asked = self._ask(wire.TOUCH, ns, keys)
        return 0 if asked is None else int(asked[1]["n"])

    # ------------------------------------------------------------------ removal
    def delete(self, ns: Namespace, key: bytes) -> bool:
        """Remove a chunk from the host pool's tiers; False while detached."""
        check_key(key)
        self._registered(ns)
        asked = self._ask(wire.DELETE, ns, [key])
        return asked is not None and int(asked[1]["n"]) > 0

    def invalidate(self, ns: Namespace | bytes) -> int:
        """Drop every chunk of a namespace this pool registered; 0 while detached."""
        self._check_open()
        known = ns if isinstance(ns, Namespace) else self._namespaces.get(bytes(ns))
        if known is None or known.id not in self._namespaces:
            return 0
        asked = self._ask(wire.INVALIDATE, known, [])
        return 0 if asked is None else int(asked[1]["n"])

    # ------------------------------------------------------------------ admin
    def flush(self, timeout: float | None = None) -> bool:
        """This engine's saves committed, then the host pool's flush (its write-behind
        queues); True while detached once the saves ran."""
        self._check_open()
        if not self._saves.flush(timeout):
            return False
        link = self._link()
        if link is None:
            return True
        try:
            meta, _ = link.call({"op": wire.FLUSH, "timeout": timeout})
        except Detached:
            return True
        return bool(meta["done"])

    def stats(self) -> dict[str, Any]:
        """This engine's own figures under ``attached``; the host pool's tenant pool's
        (KVPool.stats) beside them while attached."""
        self._check_open()
        out: dict[str, Any] = {}
        link = self._link()
        if link is not None:
            with contextlib.suppress(Detached):
                out = link.call({"op": wire.STATS})[0]["stats"]
        out["attached"] = {**self._counters.snapshot(), "attached": self.attached,
                           "saves": stats_of(self._saves)}
        return out

    def record_latency(self, enabled: bool) -> None:
        """Latency histograms live in the host pool; a no-op here."""

    def close(self) -> None:
        """Detach (the host pool releases this connection's pins and reservations).
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._saves.close()  # commits what was handed over while the link may still live
        with self._lock:
            link, self._link_now = self._link_now, None
        if link is not None:
            link.close()

    def __enter__(self) -> AttachedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
