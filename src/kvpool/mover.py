"""Moves chunks up into DRAM in the background: prefetches a caller asks for (a lookup's hits,
before the load that follows) and promotions of chunks a read found only on a slower tier.

Either way chunks are read from the lower tiers straight into reserved DRAM slots (no scratch
copy) on one background thread, so a read never pays for its own promotion. At most
``max_pending`` jobs are queued; more are skipped and counted, never waited for. Faults are
misses, as in reads: a job never raises.

A chunk is read by one move at a time: a load that moves chunks itself (``move_now``) waits
for those a background move is already reading (at most ``IN_FLIGHT_WAIT_S``) instead of
reading them a second time beside it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvpool.counters import Counters
from kvpool.errors import PoolClosedError
from kvpool.keys import Namespace
from kvpool.priority import lower_thread_priority
from kvpool.tiers.base import Tier, read_tiers
from kvpool.tiers.dram import DramTier
from kvpool.tiers.slots import SlotReservation

log = logging.getLogger("kvpool.pool")

#: How long ``move_now`` waits for a chunk another move is reading; past it the chunk is left
#: to the caller's own read.
IN_FLIGHT_WAIT_S = 10.0


class Mover:
    """``counters`` gets prefetched / promotions (chunks moved up) and *_skipped (jobs not
    queued). A prefetch's reads count as the tiers' hits (``<tier>_hits``: it reads for the
    load that follows, which then finds the chunks in DRAM); a promotion's do not (the read
    that asked for it was counted already)."""

    def __init__(self, front: DramTier, lower: Sequence[Tier], counters: Counters,
                 max_pending: int, batch: int, nice: int = 0) -> None:
        self._front = front
        self._nice = nice
        self._lower = list(lower)
        self._counters = counters
        self._max_pending = max_pending
        self._batch = batch
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._epoch = 0  # bumped by every removal: see removing()
        self._in_flight: dict[bytes, threading.Event] = {}  # key -> set when its move ends
        self._publish = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False

    def submit(self, ns: Namespace, keys: Sequence[bytes], counter: str, skipped: str,
               count_hits: bool, limit: int | None = None) -> Future[int] | None:
        """Queue a job moving ``keys`` up (those DRAM lacks, at most the first ``limit`` of
        them); None if there is nothing to do or ``max_pending`` jobs are queued (counted as
        ``skipped``). ``counter`` counts the chunks moved."""
        todo = [k for k, held in zip(keys, self._front.contains_many(keys, ns.id), strict=True)
                if not held][:limit]
        if not todo:
            return None
        return self._queue(skipped, self._job, ns, todo, counter, count_hits)

    def submit_found(self, ns: Namespace, find: Callable[[], Sequence[bytes]], counter: str,
                     skipped: str) -> Future[int] | None:
        """Queue a job that first calls ``find`` on the mover's thread for the keys to move
        up (those DRAM lacks), then moves them as ``submit`` would (the reads not counted as
        hits). For a search that may take long (a warm start's sort of the SSD index):
        the caller, perhaps a storage node's event loop, never runs it. None if
        ``max_pending`` jobs are queued (counted as ``skipped``) or the mover is closed.
        A ``find`` that raises moves nothing (logged; PoolClosedError silently)."""
        return self._queue(skipped, self._found_job, ns, find, counter)

    def _queue(self, skipped: str, job: Callable[..., int], *args: Any) -> Future[int] | None:
        """Submit ``job(*args)`` to the mover's thread (started on first use); None when the
        mover is closed or ``max_pending`` jobs are queued (counted as ``skipped``)."""
        with self._lock:
            if self._closed:
                return None
            if self._pending >= self._max_pending:
                self._counters.add(skipped)
                return None
            self._pending += 1
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvpool-mover",
                                                    initializer=lower_thread_priority,
                                                    initargs=(self._nice,))
            return self._executor.submit(job, *args)

    def _found_job(self, ns: Namespace, find: Callable[[], Sequence[bytes]],
                   counter: str) -> int:
        todo: list[bytes] = []
        try:
            keys = find()
            todo = [k for k, held in zip(keys, self._front.contains_many(keys, ns.id),
                                         strict=True) if not held]
        except PoolClosedError:
            pass  # closing: the move is moot
        except Exception:  # a background move never surfaces errors
            log.exception("finding the chunks to move up to DRAM failed")
        return self._job(ns, todo, counter, False)  # gives the pending job back

    def _job(self, ns: Namespace, keys: list[bytes], counter: str, count_hits: bool) -> int:
        moved = 0
        add = self._counters.add_many if count_hits else None
        try:
            for start in range(0, len(keys), self._batch):
                if self._closed:
                    break
                moved += self._move(ns, keys[start:start + self._batch], add)
        except PoolClosedError:
            pass  # closing: the move is moot
        except Exception:  # a read fault is a miss; a background move never surfaces errors
            log.exception("moving %d chunks up to DRAM failed", len(keys))
        finally:
            self._counters.add(counter, moved)
            with self._lock:
                self._pending -= 1
                self._idle.notify_all()
        return moved

    def pending(self) -> int:
        """Background moves queued or running now."""
        with self._lock:
            return self._pending

    def move_now(self, ns: Namespace, keys: list[bytes]) -> int:
        """Move ``keys`` up in the caller's thread, never waiting for a DRAM slot (a chunk
        that finds none stays below); the reads count as the tiers' hits. Keys another move
        is reading are not read again: this waits for that move (IN_FLIGHT_WAIT_S at most).
        Returns how many this call published. Read faults are misses (logged by the tiers);
        raises PoolClosedError when the pool closes meanwhile."""
        others: list[threading.Event] = []
        moved = self._move(ns, keys, self._counters.add_many, wait=False, others=others)
        for done in others:
            done.wait(IN_FLIGHT_WAIT_S)
        return moved

    def _claim(self, keys: list[bytes], done: threading.Event,
               others: list[threading.Event] | None) -> list[bytes]:
        """The keys no other move is reading, now marked as this move's; the events of the
        moves reading the rest go to ``others`` (when given)."""
        mine = []
        with self._lock:
            for key in keys:
                theirs = self._in_flight.get(key)
                if theirs is None:
                    self._in_flight[key] = done
                    mine.append(key)
                elif others is not None and theirs not in others:
                    others.append(theirs)
        return mine

    def _release(self, keys: list[bytes], done: threading.Event) -> None:
        with self._lock:
            for key in keys:
                if self._in_flight.get(key) is done:
                    del self._in_flight[key]
        done.set()

    def _move(self, ns: Namespace, keys: list[bytes],
              add: Callable[[dict[str, int]], None] | None, wait: bool = True,
              others: list[threading.Event] | None = None) -> int:
        """Reserve DRAM slots, claim the reserved keys no other move is reading (their
        movers' events go to ``others``), read the claimed ones straight into their slots,
        publish unless a removal ended meanwhile."""
        slots: dict[bytes, SlotReservation] = {}
        done = threading.Event()
        claimed: list[bytes] = []
        epoch = self._epoch  # a delete or invalidation from here on voids this move
        try:
            for key in keys:
                slot = self._front.reserve(key, ns, ns.chunk_bytes, on_lower=True, wait=wait)
                if isinstance(slot, SlotReservation):  # True: already there; False: no room
                    slots[key] = slot
            claimed = self._claim(list(slots), done, others)
            views = [slots[key].view for key in claimed]
            counts: dict[str, int] | None = {} if add is not None else None
            served = read_tiers(self._lower, ns, claimed, views, counts)
            if add is not None and counts:
                add(counts)
            moved = 0
            with self._publish:  # no removal runs between the check and the publish
                if self._epoch == epoch:
                    for key, tier in zip(claimed, served, strict=True):
                        if tier >= 0:
                            moved += slots[key].commit()
            return moved
        finally:
            for slot in slots.values():
                slot.abort()  # the misses and the unclaimed (a no-op for the committed ones)
            self._release(claimed, done)

    @contextlib.contextmanager
    def removing(self) -> Iterator[None]:
        """Wrap a removal (delete, invalidate): no move publishes while it runs, and a move
        that read before it ended does not publish at all, so a removed chunk never comes
        back through a move that was already reading it."""
        with self._publish:
            try:
                yield
            finally:
                self._epoch += 1

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no job is queued or running; False on timeout."""
        with self._lock:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        """Stop taking jobs, let the running one stop at its next batch. Idempotent."""
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
