"""One attached engine's connection, on the host pool's side: its namespaces, and the pins
and reservations it holds, which belong to the connection and die with it.

``handle`` serves one request against the tenant's pool and returns the answer (None for
the ops that have none). Misuse (an unknown namespace, a namespace of another tenant, a
malformed request) is answered ``ok: false`` with the reason; the connection stays up.
``close`` releases every pin and aborts every reservation, whatever state the engine died
in (a SIGKILL mid-save leaves reservations that are never committed: they are aborted
here, and no reader ever saw their slots).
"""

from __future__ import annotations

from typing import Any

from kvpool.errors import KVPoolError
from kvpool.host import wire
from kvpool.host.tenants import SHARED_TENANT, TenantPool
from kvpool.keys import Namespace
from kvpool.pool import ChunkReservation
from kvpool.retention import Retention
from kvpool.tiers.slots import PinnedBatch, PinnedView

Answer = tuple[dict[str, Any], bytes | bytearray | memoryview]


class _BatchPin:
    """The chunks of one batched pin (an attached get: released together), held under one
    pin id: the DRAM-resident ones pinned as one PinnedBatch, the ones fetched from lower
    tiers as views."""

    __slots__ = ("batch", "count", "fetched")

    def __init__(self, batch: PinnedBatch, fetched: list[PinnedView]) -> None:
        self.batch, self.fetched = batch, fetched
        self.count = batch.pinned + len(fetched)

    def release(self) -> None:
        self.batch.release()
        for view in self.fetched:
            view.release()


#: A pin answer's pair for a key not pinned, and for one carried in the answer's tail.
_MISSED = (0, wire.MISS)
_CARRIED = (0, wire.IN_TAIL)


class Refused(KVPoolError):
    """A request this connection may not make; answered ``ok: false``."""


class Session:
    def __init__(self, tenant: TenantPool, max_held: int, max_payload: int) -> None:
        self.tenant = tenant
        self.pool = tenant.pool
        self._max_held = max_held
        self._max_payload = max_payload  # an answer's tail stays within the peer's limit
        self._namespaces: dict[str, Namespace] = {}
        self._pins: dict[int, PinnedView | _BatchPin] = {}
        self._batched = 0  # chunks held by _BatchPin entries beyond their one pin id each
        self._reservations: dict[int, ChunkReservation] = {}
        #: Reservations of the engine's saves: every engine's lookups count them and reads
        #: wait for their commit (the tenant pool's read-your-writes) until they end.
        self._saving: set[int] = set()
        self._next = 0

    @property
    def held(self) -> int:
        return len(self._pins) + self._batched + len(self._reservations)

    def _id(self) -> int:
        self._next += 1
        return self._next

    def _ns(self, meta: dict[str, Any]) -> Namespace:
        ns = self._namespaces.get(str(meta.get("ns")))
        if ns is None:
            raise Refused(f"namespace {meta.get('ns')!r} is not registered on this connection")
        return ns

    def _keys(self, meta: dict[str, Any], tail: bytearray) -> list[bytes]:
        n = meta.get("n")
        if not isinstance(n, int):
            raise Refused("n must be an integer")
        try:
            return wire.unpack_keys(tail, n)
        except wire.WireError as exc:
            raise Refused(str(exc)) from None

    def _ids(self, meta: dict[str, Any], field: str = "ids") -> list[int]:
        ids = meta.get(field)
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise Refused(f"{field} must be a list of integers")
        return ids

    def handle(self, meta: dict[str, Any], tail: bytearray) -> Answer | None:
        op = meta.get("op")
        handler = getattr(self, f"_op_{op}", None) if isinstance(op, str) else None
        try:
            if wire.UNPIN_FIELD in meta:  # pins released before this request
                self._unpin(self._ids(meta, wire.UNPIN_FIELD))
            if handler is None:
                raise Refused(f"unknown op {op!r}")
            answer: Answer | None = handler(meta, tail)
        except (Refused, KVPoolError, ValueError, TypeError) as exc:
            if op in wire.NO_ANSWER:
                return None
            return {"ok": False, "error": str(exc), "kind": type(exc).__name__}, b""
        return answer

    # ------------------------------------------------------------------ ops
    def _op_ns(self, meta: dict[str, Any], tail: bytearray) -> Answer:
        ns = Namespace.from_canonical(meta.get("spec"))
        if self.tenant.name != SHARED_TENANT and ns.tenant != self.tenant.name:
            raise Refused(f"namespace of tenant {ns.tenant!r} on a connection of tenant "
                          f"{self.tenant.name!r}")
        self.pool.register_namespace(ns)
        self._namespaces[ns.id.hex()] = ns
        return {"ok": True}, b""

    def _op_lookup(self, meta: dict[str, Any], tail: bytearray) -> Answer:
        prefetch = meta.get("prefetch", 0)
        n = self.pool.lookup(self._ns(meta), self._keys(meta, tail),
                             prefetch=prefetch if isinstance(prefetch, int) else 0)
        return {"ok": True, "n": n}, b""

    def _op_contains(self, meta: dict[str, Any], tail: bytearray) -> Answer:
        flags = self.pool.contains_many(self._ns(meta), self._keys(meta, tail))
        return {"ok": True, "flags": flags}, b""

    def _op_pin(self, meta: dict[str, Any], tail: bytearray) -> Answer:
        """Pin what DRAM holds (``fetch``: reading lower tiers' chunks into free slots
        first); with ``read``, the chunks left unpinned are read into scratch and sent in
        the tail (a miss there is counted as the pool's get counts it), as many as fit in
        ``host.max_frame_bytes``: the rest stay misses. Chunks this connection itself is
        saving (reserved, not committed) are misses here, never waited for: the engine
        is the one that would commit them."""
        ns, keys = self._ns(meta), self._keys(meta, tail)
        own = self._own_saving(ns, keys)
        if meta.get("batch") is True and not any(own) \
                and self.held + len(keys) <= self._max_held:
            batched = self._pin_batch(ns, keys, fetch=bool(meta.get("fetch")))
            if batched is not None:
                return self._with_reads(meta, ns, keys, batched, own)
        ask = [i for i, mine in enumerate(own) if not mine]
        views: list[PinnedView | None] = [None] * len(keys)
        got = self.pool.pin_many(ns, [keys[i] for i in ask],
                                 fetch=bool(meta.get("fetch")))
        for i, view in zip(ask, got, strict=True):
            views[i] = view
        out: list[tuple[int, int]] = []
        for view in views:
            if view is None:
                out.append(_MISSED)
            elif self.held >= self._max_held:
                view.release()
                out.append(_MISSED)
            else:
                pin = self._id()
                self._pins[pin] = view
                out.append((pin, view.offset))
        return self._with_reads(meta, ns, keys, out, own)

    def _pin_batch(self, ns: Namespace, keys: list[bytes],
                   fetch: bool) -> list[tuple[int, int]] | None:
        """``pin`` with ``batch``: one pin id for every chunk pinned (the engine unpins them
        together), the resident ones under one DRAM lock (``pin_resident``), then, with
        ``fetch``, the others read from lower tiers into free slots. The answer's pairs
        (pin id, arena offset), ``_MISSED`` for the others; None without a DRAM tier."""
        batch = self.pool.pin_resident(ns, keys, views=False)
        if batch is None:
            return None
        offsets = list(batch.offsets)
        missing = [i for i, off in enumerate(offsets) if off is None]
        fetched: list[PinnedView] = []
        if missing and fetch:
            got = self.pool.pin_many(ns, [keys[i] for i in missing], fetch=True)
            for i, view in zip(missing, got, strict=True):
                if view is not None:
                    offsets[i] = view.offset
                    fetched.append(view)
        held = _BatchPin(batch, fetched)
        if not held.count:
            held.release()
            return [_MISSED] * len(keys)
        pin = self._id()
        self._pins[pin] = held
        self._batched += held.count - 1
        return [_MISSED if off is None else (pin, off) for off in offsets]

    def _with_reads(self, meta: dict[str, Any], ns: Namespace, keys: list[bytes],
                    out: list[tuple[int, int]], own: list[bool]) -> Answer:
        """The pin answer: ``n`` pairs in the tail (``wire.pack_pins``); with ``read``, the
        chunks left unpinned read into the tail after them (offset ``wire.IN_TAIL``), in
        key order, as many as fit in the peer's frame limit."""
        payload: list[bytearray] = []
        if meta.get("read"):
            room = self._max_payload - len(out) * wire.PAIR_BYTES
            fit = max(room, 0) // ns.chunk_bytes
            missing = [i for i, v in enumerate(out) if v[1] == wire.MISS and not own[i]][:fit]
            if missing:
                scratch = [bytearray(ns.chunk_bytes) for _ in missing]
                found = self.pool.get_many_into(ns, [keys[i] for i in missing], scratch)
                for i, buf, hit in zip(missing, scratch, found, strict=True):
                    if hit:
                        out[i] = _CARRIED
                        payload.append(buf)
        pairs = wire.pack_pins(out)
        return {"ok": True, "n": len(out)}, b"".join([pairs, *payload]) if payload else pairs

    def _op_unpin(self, meta: dict[str, Any], tail: bytearray) -> None:
        self._unpin(self._ids(meta))

    def _unpin(self, ids: list[int]) -> None:
        for pin in ids:
            view = self._pins.pop(pin, None)
            if isinstance(view, _BatchPin):
                self._batched -= view.count - 1
            if view is not None:
                view.release()

    def _op_reserve(self, meta: dict[str, Any], tail: bytearray) -> Answer:
        ns, keys = self._ns(meta), self._keys(meta, tail)
        room = self._max_held - self.held
        got = self.pool.reserve_many(ns, keys[:max(room, 0)], wait=meta.get("wait") is not False)
        out: list[Any] = []
        for r in got:
            if isinstance(r, ChunkReservation):
                rid = self._id()
                self._reservations[rid] = r
                out.append([rid, r.slot.offset if r.slot is not None else -1])
            else:
                out.append(1 if r else 0)
        out.extend([0] * (len(keys) - len(got)))  # past max_held: dropped
        if meta.get("save") is True:
            saving = [o[0] for o in out if isinstance(o, list)]
            self._saving.update(saving)
            self._mark(saving, True)
        return {"ok": True, "res": out}, b""

    def _op_put(self, meta: dict[str, Any], tail: bytearray) -> None:
        """The payload of a reservation that got no arena slot (scratch), before its commit."""
        r = self._reservations.get(meta.get("id", -1))
        if r is not None and r.slot is None and len(tail) == r.view.nbytes:
            r.view[:] = tail

    def _own_saving(self, ns: Namespace, keys: list[bytes]) -> list[bool]:
        """Per key: does this connection hold a save's reservation of it?"""
        if not self._saving:
            return [False] * len(keys)
        mine = {r.key for rid in self._saving
                if (r := self._reservations[rid]).ns.id == ns.id}
        return [k in mine for k in keys]

    def _mark(self, ids: list[int], on: bool) -> None:
        by_ns: dict[bytes, tuple[Namespace, list[bytes]]] = {}
        for rid in ids:
            r = self._reservations[rid]
            by_ns.setdefault(r.ns.id, (r.ns, []))[1].append(r.key)
        for ns, keys in by_ns.values():
            self.pool.mark_saving(ns, keys, on)

    def _end(self, ids: list[int]) -> list[ChunkReservation]:
        """Take reservations off this connection (unmarking those being saved)."""
        ids = [rid for rid in dict.fromkeys(ids) if rid in self._reservations]
        saving = [rid for rid in ids if rid in self._saving]
        try:
            return [self._reservations[rid] for rid in ids]
        finally:
            if saving:
                self._saving.difference_update(saving)
                self._mark(saving, False)
            for rid in ids:
                del self._reservations[rid]

    def _op_commit(self, meta: dict[str, Any], tail: bytearray) -> Answer:
        ids = [rid for rid in self._ids(meta) if rid in self._reservations]
        taken = [self._reservations[rid] for rid in ids]
        try:
            n = self.pool.commit_many(taken) if taken else 0
        finally:
            self._end(ids)
        return {"ok": True, "n": n}, b""

    def _op_abort(self, meta: dict[str, Any], tail: bytearray) -> None:
        for r in self._end(self._ids(meta)):
            r.abort()

    def _op_retain(self, meta: dict[str, Any], tail: bytearray) -> Answer:
        spec = meta.get("retention")
        if not isinstance(spec, dict):
            raise Refused("retention must be an object")
        retention = Retention.from_mapping(spec)  # ArgumentError: answered ok: false
        self.pool.retain(self._ns(meta), self._keys(meta, tail), retention)
        return {"ok": True}, b""

    def _op_release(self, meta: dict[str, Any], tail: bytearray) -> Answer:
        session = meta.get("session")
        if not isinstance(session, str):
            raise Refused("session must be a string")
        return {"ok": True, "n": self.pool.release(session, meta.get("delete") is True)}, b""

    def _op_delete(self, meta: dict[str, Any], tail: bytearray) -> Answer:
        ns = self._ns(meta)
        return {"ok": True, "n": sum(self.pool.delete(ns, k)
                                     for k in self._keys(meta, tail))}, b""

    def _op_invalidate(self, meta: dict[str, Any], tail: bytearray) -> Answer:
        return {"ok": True, "n": self.pool.invalidate(self._ns(meta))}, b""

    def _op_reads(self, meta: dict[str, Any], tail: bytearray) -> None:
        """Chunks the engine read through the directory: counted as the pins they replaced
        (hits, eviction recency), late. More than ``wire.MAX_READS_KEYS`` is refused (not
        counted): an engine never sends so many at once."""
        n = meta.get("n")
        if not isinstance(n, int) or n > wire.MAX_READS_KEYS:
            raise Refused(f"a reads frame carries at most {wire.MAX_READS_KEYS} keys")
        self.pool.note_dram_reads(self._ns(meta), self._keys(meta, tail))

    def _op_touch(self, meta: dict[str, Any], tail: bytearray) -> Answer:
        return {"ok": True, "n": self.pool.touch(self._ns(meta), self._keys(meta, tail))}, b""

    def _op_flush(self, meta: dict[str, Any], tail: bytearray) -> Answer:
        timeout = meta.get("timeout")
        return {"ok": True, "done": self.pool.flush(
            float(timeout) if isinstance(timeout, int | float) else None)}, b""

    def _op_stats(self, meta: dict[str, Any], tail: bytearray) -> Answer:
        stats = self.pool.stats()
        stats["host"] = {"tenant": self.tenant.name, "held": self.held}
        return {"ok": True, "stats": stats}, b""

    def close(self) -> None:
        """Release every pin, abort every reservation. Idempotent; never raises."""
        pins, self._pins = list(self._pins.values()), {}
        self._batched = 0
        for view in pins:
            view.release()
        reservations = self._end(list(self._reservations))
        for r in reservations:
            r.abort()
