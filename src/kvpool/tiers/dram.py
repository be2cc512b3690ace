"""The DRAM tier: chunks in slots of a SlotArena, indexed by key, evicted by a policy object.

Failure contract: a miss is False; a put that finds no slot (everything pinned) within
``put_wait_s`` is dropped and counted (False), never blocks longer; misuse raises.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvpool.buffers import byte_view
from kvpool.errors import ChunkSizeError, PoolClosedError
from kvpool.events.sink import TierEvents
from kvpool.keys import Namespace
from kvpool.policy import EvictionPolicy, make_eviction_policy
from kvpool.retention import RetainingPolicy, RetentionBook, TenantQuotas
from kvpool.tiers.arena import SlotArena
from kvpool.tiers.base import DemotionSink, Item, local_lookup
from kvpool.tiers.directory import ReadDirectory
from kvpool.tiers.slots import PinnedBatch, PinnedView, SlotReservation, _Entry

__all__ = ["DramTier", "PinnedBatch", "PinnedView", "SlotReservation"]

#: Reads counted afterwards (``note_reads``) per acquisition of the tier's lock.
_NOTE_BATCH = 1024


class DramTier:
    """Thread-safe. Raises ValueError for a bad geometry (see SlotArena). Evicted chunks go to
    ``demote`` (the pool gives it a Demoter writing to the tiers below), outside the lock."""

    name: str = "dram"
    label: str = "dram"
    stats_key: tuple[str, ...] = ("dram",)

    def __init__(self, capacity: int, slab_size: int = 64 << 20, eviction: str = "s3fifo",
                 shm_path: str | None = None, demote: DemotionSink | None = None,
                 put_wait_s: float = 1.0, prefault: str = "none",
                 retention: RetentionBook | None = None,
                 quotas: TenantQuotas | None = None) -> None:
        self._arena = SlotArena(capacity, slab_size, shm_path, prefault)
        self._eviction = eviction
        # Validate the name now, not at the first eviction; only a policy that uses batch
        # hints gets them (lru and s3fifo: no extra lock round per put_many).
        self._batch_hints = type(make_eviction_policy(eviction)).put_batch \
            is not EvictionPolicy.put_batch
        self._policies: dict[int, EvictionPolicy] = {}
        self._entries: dict[bytes, _Entry] = {}
        self._doomed: dict[int, _Entry] = {}  # deleted while pinned, by slot offset
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        #: Threads waiting on ``_cond`` for a slot to free up (an unpin wakes them only
        #: when there are some: Condition.notify_all is Python code, a pin's largest cost).
        self._waiters = 0
        self._demote = demote
        #: KV events (docs/routing.md): told of every chunk stored and removed; None: off.
        self.events: TierEvents | None = None
        #: Where each resident chunk lies, for attached engines' reads without a round
        #: trip (tiers/directory.py; a host pool's tenant pools): None, off.
        self.directory: ReadDirectory | None = None
        self._put_wait_s = put_wait_s
        #: Retention (retention/): wraps each policy; quotas bound each tenant's bytes.
        self._retention = retention
        self._quotas = quotas if quotas is not None and quotas.enabled else None
        self._closed = False
        self._counters: dict[str, int] = dict.fromkeys(
            ("puts", "put_bytes", "hits", "misses", "evictions", "dropped_puts",
             "slab_steals", "namespace_mismatches", "quota_drops"), 0)

    @property
    def capacity(self) -> int:
        return self._arena.capacity

    def check_chunk_size(self, nbytes: int) -> None:
        """Raises ValueError if a chunk of ``nbytes`` can never fit this arena."""
        self._arena.slot_size_for(nbytes)

    def register_namespace(self, ns: Namespace) -> None:
        self.check_chunk_size(ns.chunk_bytes)

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("DRAM tier is closed")

    def share_directory(self, directory: ReadDirectory) -> None:
        """Keep ``directory`` from now on (every resident chunk published at once); the tier
        closes it when it closes."""
        with self._lock:
            self._check_open()
            self.directory = directory
            for key, entry in self._entries.items():
                directory.publish(key, entry.ns.id, entry.offset, entry.nbytes,
                                  self._expires_at(key))

    def _expires_at(self, key: bytes) -> float:
        """The chunk's TTL deadline (wall clock) for the directory; inf without one."""
        meta = self._retention.entries.get(key) if self._retention is not None else None
        return math.inf if meta is None or meta.expires_at is None else meta.expires_at

    def retention_changed(self, keys: Sequence[bytes]) -> None:
        """Retention was recorded for ``keys``: the directory's TTL deadlines follow."""
        if self.directory is None:
            return
        with self._lock:
            if self.directory is not None and not self._closed:
                for key in keys:
                    self.directory.expiry(key, self._expires_at(key))

    def _policy(self, slot_size: int) -> EvictionPolicy:
        policy = self._policies.get(slot_size)
        if policy is None:
            policy = make_eviction_policy(self._eviction)
            if self._retention is not None:
                policy = RetainingPolicy(policy, self._retention)
            self._policies[slot_size] = policy
        return policy

    # ------------------------------------------------------------------ writes
    def put(self, key: bytes, ns: Namespace, data: Any, on_lower: bool = False) -> bool:
        """Copy a chunk into a slot, evicting by policy if needed. True if stored (or already
        present: chunks are immutable); False if dropped because every slot stayed pinned for
        ``put_wait_s`` (counted). ``on_lower`` marks a chunk a lower tier already holds, so
        its eviction needs no demotion."""
        view = byte_view(data)
        reservation = self.reserve(key, ns, view.nbytes, on_lower)
        if reservation is None or isinstance(reservation, bool):
            return bool(reservation)
        reservation.view[:] = view
        return reservation.commit()

    def put_many(self, items: Sequence[Item]) -> list[bool]:
        """``put`` per item; the keys are then passed to the eviction policy as one batch in
        prefix order (see ``note_put_batch``)."""
        stored = [self.put(key, ns, view) for key, ns, view in items]
        self.note_put_batch([key for key, _, _ in items])
        return stored

    def note_put_batch(self, keys: Sequence[bytes]) -> None:
        """Tell the eviction policy that ``keys`` were just put by one batched call, in prefix
        order (each the parent of the next): the pool calls this after storing a put_many or
        commit_many. Keys no longer resident are skipped; a prefix-aware policy (``prefix``)
        orders the batch so its tail is evicted first, the others ignore it. Never raises
        for unknown keys; a closed tier ignores the call."""
        if len(keys) < 2 or not self._batch_hints:
            return
        with self._lock:
            if self._closed:
                return
            by_class: dict[int, list[bytes]] = {}
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None:
                    by_class.setdefault(entry.slot_size, []).append(key)
            for slot_size, batch in by_class.items():
                self._policy(slot_size).put_batch(batch)

    def reserve(self, key: bytes, ns: Namespace, nbytes: int, on_lower: bool = False,
                wait: bool = True) -> SlotReservation | bool | None:
        """Take a slot for a chunk that the caller fills in place (a network receive lands
        straight in DRAM), then ``commit()`` or ``abort()``. Returns True instead if the chunk
        is already stored (nothing to write), False if dropped for lack of a slot (counted).
        With ``wait=False`` it never blocks: None means "every slot is pinned right now"
        (not counted; call again with wait=True from a thread that may block).
        Until committed the chunk is invisible to readers."""
        slot_size = self._arena.slot_size_for(nbytes)
        evicted: list[tuple[bytes, _Entry]] = []
        with self._lock:
            self._check_open()
            existing = self._entries.get(key)
            if existing is not None:
                existing.on_lower |= on_lower
                self._policy(slot_size).touch(key)
                return True
            tenant = ns.tenant if self._quotas is not None else None
            if tenant is not None and self._quotas is not None \
                    and self._quotas.dram_full(tenant, slot_size):
                offset = self._alloc_own_locked(slot_size, evicted, tenant)
                if offset is None:
                    self._counters["quota_drops"] += 1
                    self._quotas.dropped(tenant)
                    self._hand_over(evicted)
                    return False
            else:
                offset = self._alloc_locked(slot_size, evicted, wait)
            if offset is not None and tenant is not None and self._quotas is not None:
                self._quotas.charge_dram(tenant, slot_size)
        self._hand_over(evicted)
        if offset is None:
            if not wait:
                return None
            self._counters["dropped_puts"] += 1
            return False
        entry = _Entry(offset, slot_size, nbytes, ns, on_lower=on_lower)
        return SlotReservation(self, key, entry, self._arena.view(offset, nbytes))

    def _commit(self, key: bytes, entry: _Entry) -> bool:
        with self._lock:
            if key in self._entries or self._closed:  # a concurrent put of the same chunk won
                self._release_slot(entry)
                self._uncharge(entry)
                return True
            if self._retention is not None and self._retention.entries:
                entry.ephemeral = self._retention.ephemeral(key)
            self._entries[key] = entry
            if self.directory is not None:
                self.directory.publish(key, entry.ns.id, entry.offset, entry.nbytes,
                                       self._expires_at(key))
            self._policy(entry.slot_size).insert(key)
            self._counters["puts"] += 1
            self._counters["put_bytes"] += entry.nbytes
            if self.events is not None:
                self.events.stored((key,), entry.ns)
        return True

    def _abort(self, entry: _Entry) -> None:
        with self._lock:
            if not self._closed:
                self._release_slot(entry)
                self._uncharge(entry)

    def _uncharge(self, entry: _Entry) -> None:
        """A reserved slot given back unpublished: its quota charge too."""
        if self._quotas is not None:
            self._quotas.charge_dram(entry.ns.tenant, -entry.slot_size)

    def _alloc_locked(self, slot_size: int, evicted: list[tuple[bytes, _Entry]],
                      wait: bool = True) -> int | None:
        deadline: float | None = None
        while True:
            offset = self._arena.alloc(slot_size)
            if offset is not None:
                return offset
            victim = self._policy(slot_size).evict(self._evictable)
            if isinstance(victim, bytes):
                return self._take_victim_locked(victim, evicted)
            if self._steal_slab_locked(slot_size, evicted):
                continue
            if not wait:
                return None
            now = time.monotonic()
            deadline = now + self._put_wait_s if deadline is None else deadline
            if now >= deadline or self._closed:
                return None
            self._waiters += 1
            try:
                self._cond.wait(deadline - now)
            finally:
                self._waiters -= 1

    def _take_victim_locked(self, victim: bytes, evicted: list[tuple[bytes, _Entry]]) -> int:
        entry = self._entries.pop(victim)
        if self.directory is not None:
            self.directory.withdraw(victim)
        # The slot is ours alone from here: its bytes stay intact until our copy, so
        # the hook may read them after the lock is released.
        evicted.append((victim, entry))
        self._counters["evictions"] += 1
        self._left(victim, entry)
        return int(entry.offset)  # same size class: the victim's slot becomes ours

    def _alloc_own_locked(self, slot_size: int, evicted: list[tuple[bytes, _Entry]],
                          tenant: str) -> int | None:
        """A slot for a tenant at its DRAM quota: the slot of one of its own chunks of this
        size class (by policy and retention), never a free one nor another tenant's; None
        when none of its own can go (the save is dropped, never waited for)."""
        entries = self._entries

        def own(key: Any) -> bool:
            entry = entries[key]
            return entry.pins == 0 and entry.ns.tenant == tenant

        victim = self._policy(slot_size).evict(own)
        return self._take_victim_locked(victim, evicted) if isinstance(victim, bytes) else None

    def _left(self, key: bytes, entry: _Entry) -> None:
        """A chunk left DRAM (evicted, deleted, its slab stolen): retention and quota books."""
        if self._quotas is not None:
            self._quotas.charge_dram(entry.ns.tenant, -entry.slot_size)
        if self._retention is not None and key in self._retention.entries:
            self._retention.left_dram(key)

    def _evictable(self, key: Any) -> bool:
        return self._entries[key].pins == 0

    def _steal_slab_locked(self, slot_size: int, evicted: list[tuple[bytes, _Entry]]) -> bool:
        """Move one slab from the size class holding the most slabs to ``slot_size``, evicting
        the residents of the slab; False if no slab can be freed now. A slab is busy while a
        resident is pinned or any other slot of it is taken: a reservation being filled (a
        receive, a promotion, a warm start), a victim's slot handed to a writer, a doomed
        slot still pinned. Stealing it then would give that memory to two chunks."""
        donors = sorted((c for s, c in self._arena.classes.items() if s != slot_size and c.slabs),
                        key=lambda c: len(c.slabs), reverse=True)
        for donor in donors:
            for slab in donor.slabs:
                residents = [(k, e) for k, e in self._entries.items()
                             if e.slot_size == donor.slot_size
                             and self._arena.slab_of(e.offset) == slab]
                if (any(e.pins for _, e in residents)
                        or self._arena.slots_taken(donor, slab) != len(residents)):
                    continue
                for key, entry in residents:
                    del self._entries[key]
                    if self.directory is not None:
                        self.directory.withdraw(key)
                    self._policy(donor.slot_size).remove(key)
                    self._left(key, entry)
                    self._arena.free(entry.slot_size, entry.offset)
                    self._counters["evictions"] += 1
                # Other threads may write into the slab as soon as the lock drops, so these
                # victims are shown to the hook now, under the lock (steals are rare).
                self._hand_over(residents)
                self._arena.take_slab(donor, slab)
                self._arena.give_slab(self._arena.size_class(slot_size), slab)
                self._counters["slab_steals"] += 1
                return True
        return False

    def _hand_over(self, evicted: list[tuple[bytes, _Entry]]) -> None:
        """Hand evicted chunks to the demotion sink, outside the lock (a stolen slab's victims
        are shown before this thread writes into the slab)."""
        if self.events is not None:
            for key, entry in evicted:
                self.events.removed((key,), entry.ns)
        if self._demote is None:
            return
        for key, entry in evicted:
            if entry.ephemeral:
                continue
            self._demote.demote(key, entry.ns, self._arena.view(entry.offset, entry.nbytes),
                                entry.hits, entry.on_lower)

    def _release_slot(self, entry: _Entry) -> None:
        self._arena.free(entry.slot_size, entry.offset)
        self._cond.notify_all()

    # ------------------------------------------------------------------ reads
    def _pin(self, key: bytes, namespace_id: bytes | None,
             count_miss: bool = True, count_hit: bool = True) -> _Entry | None:
        with self._lock:
            self._check_open()
            entry = self._entries.get(key)
            retention = self._retention
            if entry is not None and retention is not None \
                    and (retention.any_expired or key in retention.entries) \
                    and retention.expired(key):
                entry = None  # its TTL passed: a miss until the pool drops it
            if entry is None or (namespace_id is not None and entry.ns.id != namespace_id):
                if count_miss:
                    self._counters["misses"] += 1
                    if entry is not None:
                        self._counters["namespace_mismatches"] += 1
                return None
            entry.pins += 1
            if count_hit:
                entry.hits += 1
                self._counters["hits"] += 1
                self._policy(entry.slot_size).touch(key)
            return entry

    def _unpin(self, entry: _Entry) -> None:
        with self._lock:
            entry.pins -= 1
            if entry.pins == 0 and entry.doomed:
                del self._doomed[entry.offset]
                if not self._closed:
                    self._release_slot(entry)
            elif entry.pins == 0 and self._waiters:
                self._cond.notify_all()

    def pin_batch(self, keys: Sequence[bytes], namespace_id: bytes,
                  views: bool = True) -> PinnedBatch:
        """``view`` for a batch under one lock acquisition and without a PinnedView per key
        (a storage node's GET): each resident chunk stored under ``namespace_id`` is pinned;
        the others are None and, as with ``count_miss=False``, not counted. Without ``views``
        only the slots' offsets are kept (a host pool's engines read them through their own
        mapping). The pinned chunks are counted as hits and touched in their policy when the
        batch is released (``unpin_batch``, under the lock it takes anyway), after their
        bytes were sent: a node's GET answers before its bookkeeping. Release the batch once
        its views are sent. Raises PoolClosedError after close."""
        offsets: list[int | None] = []
        pinned: list[_Entry] = []
        pinned_keys: list[bytes] = []
        retention = self._retention
        with self._lock:
            self._check_open()
            get = self._entries.get
            # The TTL check only where some chunk has retention (hoisted: a batch is read
            # at one moment).
            expired = retention.expired if retention is not None and (
                retention.any_expired or retention.entries) else None
            for key in keys:
                entry = get(key)
                if entry is None or entry.ns.id != namespace_id or (
                        expired is not None and expired(key)):
                    offsets.append(None)  # absent, another namespace's, or its TTL passed
                    continue
                entry.pins += 1
                pinned.append(entry)
                pinned_keys.append(key)
                offsets.append(entry.offset)
            if not views:
                return PinnedBatch(self, pinned, pinned_keys, offsets, [])
            arena, entries = self._arena, iter(pinned)
            return PinnedBatch(self, pinned, pinned_keys, offsets, [
                None if off is None else arena.view(off, next(entries).nbytes).toreadonly()
                for off in offsets])

    def unpin_batch(self, entries: Sequence[_Entry], keys: Sequence[bytes]) -> None:
        """Give back the pins of ``pin_batch`` (PinnedBatch.release; ``keys[i]`` is
        ``entries[i]``'s), under one lock: each read is counted as a hit (as ``view`` counts
        at once), and each chunk not deleted meanwhile is touched in its slot size's policy
        (a deleted one's slot is freed at its last unpin)."""
        with self._lock:
            wake = False
            size, policy = -1, None
            for entry, key in zip(entries, keys, strict=True):
                entry.pins -= 1
                entry.hits += 1
                if entry.doomed:
                    if entry.pins == 0:
                        del self._doomed[entry.offset]
                        if not self._closed:
                            self._release_slot(entry)
                    continue
                if not self._closed:
                    if entry.slot_size != size:  # the policy looked up once per slot size
                        size, policy = entry.slot_size, self._policy(entry.slot_size)
                    policy.touch(key)  # type: ignore[union-attr]
                if entry.pins == 0:
                    wake = True
            self._counters["hits"] += len(entries)
            if wake and self._waiters:
                self._cond.notify_all()

    def get_into(self, key: bytes, out: Any, namespace_id: bytes | None = None) -> bool:
        """Copy a chunk into ``out``. False on a miss, or when ``namespace_id`` is given and
        the chunk was stored under another namespace; ChunkSizeError if ``out``'s size
        differs from the stored chunk."""
        view = byte_view(out, writable=True)
        entry = self._pin(key, namespace_id)
        if entry is None:
            return False
        try:
            if view.nbytes != entry.nbytes:
                raise ChunkSizeError(f"output buffer of {view.nbytes} bytes; chunk has "
                                     f"{entry.nbytes}")
            view[:] = self._arena.view(entry.offset, entry.nbytes)
        finally:
            self._unpin(entry)
        return True

    def get_many_into(self, ns: Namespace, keys: Sequence[bytes],
                      outs: Sequence[memoryview]) -> list[bool]:
        """``get_into`` per key, under ``ns``."""
        return [self.get_into(key, out, ns.id) for key, out in zip(keys, outs, strict=True)]

    def view(self, key: bytes, namespace_id: bytes | None = None,
             count_miss: bool = True) -> PinnedView | None:
        """Zero-copy read view that pins the slot until released; None on a miss (as for
        ``get_into``). ``count_miss=False``: a miss is not counted (nor a namespace mismatch),
        for a caller whose follow-up read of the key counts it."""
        entry = self._pin(key, namespace_id, count_miss)
        if entry is None:
            return None
        return PinnedView(self, entry, self._arena.view(entry.offset, entry.nbytes).toreadonly())

    def view_to_copy(self, key: bytes) -> tuple[Namespace, int, PinnedView] | None:
        """(namespace, reads while resident, pinned view) of a resident chunk, for copying it
        to a lower tier: unlike ``view`` it counts no read (no hit, no recency). None if
        absent; PoolClosedError after close."""
        entry = self._pin(key, None, count_miss=False, count_hit=False)
        if entry is None:
            return None
        view = self._arena.view(entry.offset, entry.nbytes).toreadonly()
        return entry.ns, entry.hits, PinnedView(self, entry, view)

    def contains(self, key: bytes, namespace_id: bytes | None = None) -> bool:
        """True if the chunk is resident (stored under ``namespace_id``, when given)."""
        with self._lock:
            self._check_open()
            entry = self._entries.get(key)
            return entry is not None and (namespace_id is None or entry.ns.id == namespace_id)

    def contains_many(self, keys: Sequence[bytes], namespace_id: bytes) -> list[bool]:
        """``contains`` for a batch, under one lock acquisition."""
        with self._lock:
            self._check_open()
            return [e is not None and e.ns.id == namespace_id
                    for e in map(self._entries.get, keys)]  # map: no Python call per key

    def lookup(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        return local_lookup(self.contains_many, keys, ns.id)

    # ------------------------------------------------------------------ removal
    def _drop_locked(self, key: bytes) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        if self.directory is not None:
            self.directory.withdraw(key)
        self._policy(entry.slot_size).remove(key)
        self._left(key, entry)
        if entry.pins:
            entry.doomed = True
            self._doomed[entry.offset] = entry
        else:
            self._release_slot(entry)
        return True

    def delete(self, key: bytes, ns: Namespace | None = None) -> bool:
        """Remove a chunk; a pinned one disappears now and frees its slot when released."""
        with self._lock:
            self._check_open()
            entry = self._entries.get(key)
            dropped = self._drop_locked(key)
            if dropped and entry is not None and self.events is not None:
                self.events.removed((key,), entry.ns)
            return dropped

    def invalidate(self, namespace_id: bytes, ns: Namespace | None = None) -> int:
        with self._lock:
            self._check_open()
            doomed = [k for k, e in self._entries.items() if e.ns.id == namespace_id]
            for key in doomed:
                self._drop_locked(key)
            if doomed and self.events is not None:
                self.events.cleared(ns if ns is not None else namespace_id)
            return len(doomed)

    def mark_on_lower(self, key: bytes) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.on_lower = True

    def residents(self) -> list[tuple[bytes, Namespace, bool]]:
        """Every resident chunk as (key, namespace, on_lower), oldest put first; on_lower:
        a lower tier was known to hold it when it came in (it may have evicted it since)."""
        with self._lock:
            self._check_open()
            return [(k, e.ns, e.on_lower) for k, e in self._entries.items() if not e.ephemeral]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            used = sum(e.slot_size for e in self._entries.values())
            out: dict[str, Any] = dict(self._counters)
            out.update(entries=len(self._entries), used_bytes=used,
                       capacity_bytes=self._arena.capacity, eviction=self._eviction)
            if self.directory is not None:  # chunks readable through it; ones it had no room for
                out.update(directory_entries=len(self.directory),
                           directory_full=self.directory.full_buckets)
            return out

    def flush(self, timeout: float | None = None) -> bool:
        return True  # nothing queued: evictions are handed over as they happen

    def close(self) -> None:
        """Release the arena; later calls raise PoolClosedError. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._entries.clear()
            self._cond.notify_all()
            if self.directory is not None:
                self.directory.close()
        self._arena.close()

    def touch(self, key: bytes) -> bool:
        """Count a read of a resident chunk (its eviction recency and hit count) without
        copying it; False if absent. Holds the lock as briefly as ``contains``."""
        with self._lock:
            self._check_open()
            entry = self._entries.get(key)
            if entry is None:
                return False
            entry.hits += 1
            self._policy(entry.slot_size).touch(key)
            return True

    def touch_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [self.touch(key) for key in keys]

    def note_reads(self, keys: Sequence[bytes], namespace_id: bytes) -> int:
        """Count reads made without this tier (an attached engine's reads through the
        directory): each resident chunk of ``namespace_id`` is counted as a hit and
        touched in its policy, as a released ``pin_batch`` is, ``_NOTE_BATCH`` keys per lock
        acquisition (a long list never holds the lock long). Returns how many were; others
        (evicted since) are ignored, a closed tier counts none."""
        counted = 0
        for start in range(0, len(keys), _NOTE_BATCH):
            with self._lock:
                if self._closed:
                    return counted
                get = self._entries.get
                for key in keys[start:start + _NOTE_BATCH]:
                    entry = get(key)
                    if entry is None or entry.ns.id != namespace_id:
                        continue
                    entry.hits += 1
                    self._policy(entry.slot_size).touch(key)
                    counted += 1
                    self._counters["hits"] += 1
        return counted
