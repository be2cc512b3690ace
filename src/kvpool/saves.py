"""The pool's save and load pipeline (``KVPool.save`` / ``begin_save`` / ``load`` /
``open_load``): the one place that bounds saves, commits them in the background, makes a saved
chunk readable at once and turns a load into "the first N chunks are in place".

Save: DRAM slots are reserved (never waiting: no free slot is a counted drop), the caller
fills them in place (``fill(index, view)`` gathers engine pages straight into the slot, the
one copy between engine memory and the pool), and one background committer publishes them
(``KVPool.commit_many``: DRAM, the write-behind queues, or a synced SSD write for durable
pools). Saves not yet committed are bounded by ``pool.save_budget_bytes``: chunks beyond it
are dropped from the end of the save (a save is a prefix), counted.

Read-your-writes: a chunk handed to the committer is held for ``lookup`` / ``contains`` at
once, and a read of it (``load``, ``get_many_into``, ``pin_many``) first waits for its commit,
at most ``pool.save_commit_wait_s`` (then it is read as it is: a miss if the commit has not
landed, counted as ``load_commit_timeouts``).

Failure contract: pool faults never raise out of a save (a failed commit is a counted drop and
the ticket says how many chunks were stored); an exception raised by the caller's ``fill``
aborts that save's slots (counted as ``save_dropped_fill``) and is re-raised. A load reports
how many leading chunks it delivered; the engine recomputes from the first one it did not.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvpool.buffers import byte_view
from kvpool.counters import Counters
from kvpool.priority import lower_thread_priority
from kvpool.ssd.directio import AlignedBuffers

if TYPE_CHECKING:
    from kvpool.keys import Namespace

log = logging.getLogger("kvpool.saves")

#: ``fill(index, view)``: write chunk ``keys[index]``'s payload into ``view`` (its DRAM slot).
Fill = Callable[[int, memoryview], None]
#: ``scatter(index, view)``: copy chunk ``keys[index]`` from ``view`` (read-only) into the engine.
Scatter = Callable[[int, memoryview], None]

class Reservation(Protocol):
    """Room for one chunk being saved (KVPool's ChunkReservation, AttachedPool's
    AttachedReservation): filled through ``view``, given back by ``abort`` (a no-op once
    committed)."""

    key: bytes
    view: memoryview

    def abort(self) -> None: ...


class Pinned(Protocol):
    """A pinned read-only chunk (PinnedView, AttachedView): ``data`` until ``release``."""

    data: memoryview

    def release(self) -> None: ...


class SaveSide(Protocol):
    """What the save / load pipeline asks of a pool, embedded (KVPool) or attached
    (AttachedPool); the functions below are the pipeline itself, shared by both. Each is
    called after the pool's own checks (open, namespace registered, keys)."""

    def reserve_for_save(self, ns: Namespace, keys: Sequence[bytes],
                         saving: bool) -> Sequence[Reservation | bool | None]:
        """Per key, never waiting for a slot: a reservation, True (already stored; with
        ``saving``, also when it is on its way to a commit) or False / None (dropped)."""
        ...

    def pin_for_load(self, ns: Namespace, keys: Sequence[bytes]) -> list[Pinned | None]:
        """Pin what the fast tier holds, reading slower tiers' chunks into free slots first
        (None: not pinned); commits were waited for already."""
        ...

    def read_for_load(self, ns: Namespace, keys: Sequence[bytes],
                      views: list[memoryview]) -> list[bool]:
        """Read chunks no slot could be pinned for into ``views``; per key: found."""
        ...


#: The drop counters of saves, one per cause (``KVPool.stats()["saves"]``).
SAVE_COUNTERS = ("saves", "save_chunks", "save_stored", "save_present", "save_dropped_budget",
                 "save_dropped_no_slot", "save_dropped_fill", "save_dropped_aborted",
                 "save_dropped_commit", "load_commit_waits", "load_commit_timeouts")


class SaveTicket:
    """The outcome of one save, known once its commit ran: ``wait`` for it, then ``stored``
    (chunks the pool holds for this save, as ``put_many`` counts them) and ``present`` (chunks
    that were already stored, not written again). ``taken[i]``: chunk i was already stored or
    is handed over for its commit (False: dropped); known when ``save`` returns, for a
    deferred save once done. A save that committed nothing is done at once."""

    __slots__ = ("_done", "keys", "present", "stored", "taken")

    def __init__(self, keys: Sequence[bytes], present: int) -> None:
        self.keys = list(keys)
        self.present = present
        self.stored = 0
        self.taken = [False] * len(self.keys)
        self._done = threading.Event()

    def finish(self, stored: int) -> None:
        """Set the outcome (the pool calls it once the commit ran)."""
        self.stored = stored
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """True once the commit ran (``stored`` is final); False on timeout."""
        return self._done.wait(timeout)


class SaveBatch:
    """Slots reserved for one save (``KVPool.begin_save``), filled by the caller, then
    ``commit()``-ed or ``abort()``-ed. ``views[i]`` is the slot of ``keys[i]``; None where the
    chunk is already stored (``present``) or was dropped (no slot, over the budget): skip it.
    A caller that fills in several passes (layer by layer) keeps the batch between them."""

    __slots__ = ("_pipeline", "_reservations", "held", "keys", "ns", "present", "views")

    def __init__(self, pipeline: SavePipeline, ns: Namespace, keys: Sequence[bytes],
                 reservations: list[Reservation | None], held: list[bool]) -> None:
        self._pipeline = pipeline
        self.ns, self.keys = ns, list(keys)
        #: Per key: already stored or on its way (nothing to fill).
        self.held = held
        self.present = sum(held)
        self._reservations: list[Reservation | None] | None = reservations
        self.views: list[memoryview | None] = [r.view if r is not None else None
                                               for r in reservations]

    @property
    def reserved(self) -> int:
        return sum(v is not None for v in self.views)

    def commit(self, before: Callable[[], None] | None = None) -> SaveTicket:
        """Hand the filled slots to the committer: from now on they count for lookups and
        reads wait for their commit. Never waits for a tier. ``before`` runs on the committer
        right before the chunks are published (what must precede them there but may block,
        such as recording their retention on the storage nodes), also when nothing is left to
        publish; an exception from it is logged and the commit goes on. A second call, or
        one after ``abort``, returns a ticket of nothing (``before`` not run)."""
        reservations, self._reservations = self._reservations, None
        ticket = SaveTicket(self.keys, self.present)
        ticket.taken = [h or (reservations is not None and reservations[i] is not None)
                        for i, h in enumerate(self.held)]
        taken = [r for r in reservations or [] if r is not None]
        if reservations is None or (not taken and before is None):
            ticket.finish(0)
            return ticket
        self._pipeline.hand_over(self.ns, taken, ticket, before)
        return ticket

    def abort(self, cause: str = "save_dropped_aborted") -> None:
        """Give every slot back, counted under ``cause``. Idempotent."""
        reservations, self._reservations = self._reservations, None
        taken = [r for r in reservations or [] if r is not None]
        for r in taken:
            r.abort()
        self._pipeline.unbook(self.ns, len(taken))
        if taken:
            self._pipeline.counters.add(cause, len(taken))


class LoadHandle:
    """The chunks of one ``KVPool.open_load``: ``sources[i]`` is a read-only view of
    ``keys[i]``'s payload (a pinned DRAM slot, or a staging buffer the chunk was read into),
    None for a chunk no tier delivered. ``loaded`` is how many leading chunks are there: the
    engine recomputes from ``keys[loaded]``. ``release()`` (or the end of a ``with`` block)
    gives the pins and buffers back; the views are invalid after it."""

    def __init__(self, sources: list[memoryview | None], pins: list[Pinned | None],
                 bufs: list[np.ndarray], give: Callable[[np.ndarray], None]) -> None:
        self.sources = sources
        self._pins, self._bufs, self._give = pins, bufs, give
        n = 0
        while n < len(sources) and sources[n] is not None:
            n += 1
        self.loaded = n

    def release(self) -> None:
        """Idempotent."""
        pins, self._pins = self._pins, []
        bufs, self._bufs = self._bufs, []
        self.sources = [None] * len(self.sources)
        for pin in pins:
            if pin is not None:
                pin.release()
        for buf in bufs:
            self._give(buf)

    def __enter__(self) -> LoadHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class _Commit:
    __slots__ = ("before", "ns", "reservations", "ticket")

    def __init__(self, ns: Namespace, reservations: list[Reservation],
                 ticket: SaveTicket, before: Callable[[], None] | None = None) -> None:
        self.ns, self.reservations, self.ticket = ns, reservations, ticket
        self.before = before


class _Deferred:
    """A save whose reservation and fill run on the committer (``KVPool.save(defer=True)``)."""

    __slots__ = ("fill", "keys", "ns", "ticket")

    def __init__(self, ns: Namespace, keys: list[bytes], fill: Fill,
                 ticket: SaveTicket) -> None:
        self.ns, self.keys, self.fill, self.ticket = ns, keys, fill, ticket


class SavePipeline:
    """The budget, the chunks on their way to a commit (by namespace id and key) and the
    committer thread of one pool. ``commit`` is the pool's ``commit_many``; ``run_deferred``
    runs a deferred save (reserve, fill, commit) on the committer."""

    def __init__(self, commit: Callable[[Sequence[Reservation]], int],
                 run_deferred: Callable[[_Deferred], int], budget_bytes: int,
                 commit_wait_s: float, nice: int = 0) -> None:
        self._commit = commit
        self._run_deferred = run_deferred
        self.budget_bytes = budget_bytes
        self.commit_wait_s = commit_wait_s
        self._nice = nice
        self.counters = Counters(*SAVE_COUNTERS)
        self._lock = threading.Lock()
        self._committed = threading.Condition(self._lock)
        self._booked = 0
        self._inflight: dict[tuple[bytes, bytes], int] = {}
        self._queue: queue.SimpleQueue[_Commit | _Deferred | threading.Event | None] = \
            queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._bufs: dict[int, AlignedBuffers] = {}

    # ---------------------------------------------------------------- budget
    def book(self, ns: Namespace, chunks: int) -> int:
        """Take room for up to ``chunks`` chunks of ``ns``; returns how many fit."""
        with self._lock:
            room = min(chunks, max(0, self.budget_bytes - self._booked) // ns.chunk_bytes)
            self._booked += room * ns.chunk_bytes
            return room

    def unbook(self, ns: Namespace, chunks: int) -> None:
        if chunks:
            with self._lock:
                self._booked -= chunks * ns.chunk_bytes

    def booked_bytes(self) -> int:
        with self._lock:
            return self._booked

    # ---------------------------------------------------------------- read-your-writes
    def mark(self, ns_id: bytes, keys: Sequence[bytes]) -> None:
        """Count ``keys`` as on their way to a commit until ``unmark`` (a host pool marks
        the chunks an attached engine reserved for a save)."""
        self._mark(ns_id, keys)

    def unmark(self, ns_id: bytes, keys: Sequence[bytes]) -> None:
        self._unmark(ns_id, keys)

    def _mark(self, ns_id: bytes, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                k = (ns_id, key)
                self._inflight[k] = self._inflight.get(k, 0) + 1

    def _unmark(self, ns_id: bytes, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                k = (ns_id, key)
                left = self._inflight.pop(k) - 1
                if left:
                    self._inflight[k] = left
            self._committed.notify_all()

    def saving(self, ns_id: bytes, keys: Sequence[bytes]) -> list[bool]:
        """Per key: is it on its way to a commit?"""
        if not self._inflight:  # the common case costs no lock
            return [False] * len(keys)
        with self._lock:
            return [(ns_id, k) in self._inflight for k in keys]

    def wait_committed(self, ns_id: bytes, keys: Sequence[bytes]) -> bool:
        """Wait (at most ``commit_wait_s``) until none of ``keys`` waits for its commit;
        False (counted) on timeout. Returns at once when nothing is being saved."""
        if not self._inflight:
            return True
        with self._lock:
            def done() -> bool:
                return not any((ns_id, k) in self._inflight for k in keys)
            if done():
                return True
            self.counters.add("load_commit_waits")
            ok = self._committed.wait_for(done, self.commit_wait_s)
        if not ok:
            self.counters.add("load_commit_timeouts")
        return ok

    # ---------------------------------------------------------------- the committer
    def _start(self) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="kvpool-save",
                                                    daemon=True)
                    self._thread.start()

    def hand_over(self, ns: Namespace, reservations: list[Reservation],
                  ticket: SaveTicket, before: Callable[[], None] | None = None) -> None:
        """Mark the chunks as being saved, queue their commit, ``before`` first (after
        ``close``: drop them, ``before`` not run)."""
        if self._closed:
            for r in reservations:
                r.abort()
            self.unbook(ns, len(reservations))
            self.counters.add("save_dropped_aborted", len(reservations))
            ticket.finish(0)
            return
        self._mark(ns.id, [r.key for r in reservations])
        self._start()
        self._queue.put(_Commit(ns, reservations, ticket, before))

    def defer(self, job: _Deferred) -> None:
        if self._closed:
            self.counters.add_many({"saves": 1, "save_chunks": len(job.keys),
                                    "save_dropped_aborted": len(job.keys)})
            job.ticket.finish(0)
            return
        self._mark(job.ns.id, job.keys)
        self._start()
        self._queue.put(job)

    def _run(self) -> None:
        lower_thread_priority(self._nice)
        while True:
            job = self._queue.get()
            if job is None:
                return
            if isinstance(job, threading.Event):
                job.set()
            elif isinstance(job, _Commit):
                self._run_commit(job)
            else:
                try:
                    stored = self._run_deferred(job)
                except Exception:
                    log.exception("kvpool: a deferred save failed; dropped")
                    stored = 0
                finally:
                    self._unmark(job.ns.id, job.keys)
                job.ticket.finish(stored)

    def _run_commit(self, job: _Commit) -> None:
        if job.before is not None:
            try:
                job.before()
            except Exception:
                log.exception("kvpool: the step before committing %d saved chunks failed; "
                              "committing them anyway", len(job.reservations))
        stored = self.commit_now(job.ns, job.reservations) if job.reservations else 0
        self._unmark(job.ns.id, [r.key for r in job.reservations])
        job.ticket.finish(stored)

    def commit_now(self, ns: Namespace, reservations: list[Reservation]) -> int:
        """Commit booked, filled reservations in this thread; every fault is a counted drop.
        Returns how many are stored."""
        try:
            stored = self._commit(reservations)
        except Exception:
            log.exception("kvpool: committing %d saved chunks failed; dropped",
                          len(reservations))
            stored = 0
        finally:
            for r in reservations:
                r.abort()  # a no-op once committed
            self.unbook(ns, len(reservations))
        self.counters.add_many({"save_stored": stored,
                                "save_dropped_commit": len(reservations) - stored})
        return stored

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every save handed over so far was committed; False on timeout."""
        if self._thread is None:
            return True
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def close(self) -> None:
        """Commit what was handed over, then stop the committer. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()

    # ---------------------------------------------------------------- load staging
    def buffers(self, nbytes: int) -> AlignedBuffers:
        """Page-aligned read buffers for chunks of ``nbytes`` that find no DRAM slot."""
        with self._lock:
            bufs = self._bufs.get(nbytes)
            if bufs is None:
                bufs = self._bufs[nbytes] = AlignedBuffers(nbytes)
            return bufs


# -------------------------------------------------------------------- the pipeline itself
def begin_save(side: SaveSide, saves: SavePipeline, ns: Namespace,
               keys: list[bytes]) -> SaveBatch:
    """``begin_save`` of either pool, after its checks and its retention: book the budget,
    reserve without waiting, count the drops."""
    room = saves.book(ns, len(keys))
    found = side.reserve_for_save(ns, keys[:room], True) if room else []
    reservations: list[Reservation | None] = []
    held = [slot is True for slot in found] + [False] * (len(keys) - room)
    no_slot = 0
    for slot in found:
        if slot is None or isinstance(slot, bool):
            reservations.append(None)
            no_slot += slot is not True
        else:
            reservations.append(slot)
    saves.unbook(ns, room - sum(r is not None for r in reservations))
    reservations.extend([None] * (len(keys) - room))
    saves.counters.add_many({"saves": 1, "save_chunks": len(keys),
                             "save_present": sum(held), "save_dropped_no_slot": no_slot,
                             "save_dropped_budget": len(keys) - room})
    return SaveBatch(saves, ns, keys, reservations, held)


def save_inline(side: SaveSide, saves: SavePipeline, ns: Namespace, keys: list[bytes],
                fill: Fill) -> SaveTicket:
    """``save`` without ``defer``: reserve, ``fill`` each slot here, hand the commit over.
    An exception from ``fill`` aborts the slots (``save_dropped_fill``) and is re-raised."""
    batch = begin_save(side, saves, ns, keys)
    try:
        for i, view in enumerate(batch.views):
            if view is not None:
                fill(i, view)
    except BaseException:
        batch.abort("save_dropped_fill")
        raise
    return batch.commit()


def run_deferred(side: SaveSide, saves: SavePipeline, job: _Deferred, closed: bool) -> int:
    """A deferred save, on the save thread: reserve (its own chunks are on their way, so
    they must not count as stored), fill, commit. Returns how many are stored; a failing
    ``fill`` is logged and drops the save (``save_dropped_fill``)."""
    if closed:
        saves.counters.add_many({"saves": 1, "save_chunks": len(job.keys),
                                 "save_dropped_aborted": len(job.keys)})
        return 0
    ns, keys = job.ns, job.keys
    room = saves.book(ns, len(keys))
    found = side.reserve_for_save(ns, keys[:room], False) if room else []
    taken = [(i, r) for i, r in enumerate(found) if not (r is None or isinstance(r, bool))]
    present = sum(r is True for r in found)
    saves.unbook(ns, room - len(taken))
    saves.counters.add_many({"saves": 1, "save_chunks": len(keys), "save_present": present,
                             "save_dropped_no_slot": len(found) - present - len(taken),
                             "save_dropped_budget": len(keys) - room})
    job.ticket.present = present
    job.ticket.taken = [r is not None and r is not False for r in found] \
        + [False] * (len(keys) - room)
    try:
        for i, r in taken:
            job.fill(i, r.view)
    except Exception:
        log.exception("kvpool: filling a deferred save failed; dropped")
        for i, r in taken:
            r.abort()
            job.ticket.taken[i] = False
        saves.unbook(ns, len(taken))
        saves.counters.add("save_dropped_fill", len(taken))
        return 0
    return saves.commit_now(ns, [r for _, r in taken]) if taken else 0


def open_load(side: SaveSide, saves: SavePipeline, ns: Namespace,
              keys: list[bytes]) -> LoadHandle:
    """``open_load`` of either pool, after its checks: wait for commits in flight, pin,
    read the rest into the pipeline's staging buffers. A fault while reading releases
    what was taken and is re-raised."""
    saves.wait_committed(ns.id, keys)
    pins = side.pin_for_load(ns, keys)
    sources: list[memoryview | None] = [p.data if p is not None else None for p in pins]
    rest = [i for i, p in enumerate(pins) if p is None]
    pool_bufs = saves.buffers(ns.chunk_bytes)
    bufs = [pool_bufs.take() for _ in rest]
    if rest:
        try:
            got = side.read_for_load(ns, [keys[i] for i in rest],
                                     [byte_view(b, writable=True) for b in bufs])
        except BaseException:
            LoadHandle(sources, pins, bufs, pool_bufs.give).release()
            raise
        for i, buf, hit in zip(rest, bufs, got, strict=True):
            if hit:
                sources[i] = byte_view(buf).toreadonly()
    return LoadHandle(sources, pins, bufs, pool_bufs.give)


def load(handle: LoadHandle, scatter: Scatter) -> int:
    """``load``: ``scatter`` the handle's leading run in order, then release it (also when
    ``scatter`` raises, which is re-raised). Returns the run's length."""
    with handle:
        for i in range(handle.loaded):
            view = handle.sources[i]
            assert view is not None
            scatter(i, view)
        return handle.loaded


def stats_of(pipeline: SavePipeline) -> dict[str, Any]:
    out: dict[str, Any] = pipeline.counters.snapshot()
    out["booked_bytes"] = pipeline.booked_bytes()
    out["budget_bytes"] = pipeline.budget_bytes
    return out
