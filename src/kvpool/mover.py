"""Moves chunks up into DRAM in the background: prefetches a caller asks for (a lookup's hits,
before the load that follows) and promotions of chunks a read found only on a slower tier.

Either way chunks are read from the lower tiers straight into reserved DRAM slots (no scratch
copy) on one background thread, so a read never pays for its own promotion. At most
``max_pending`` jobs are queued; more are skipped and counted, never waited for. Faults are
misses, as in reads: a job never raises.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from kvpool.counters import Counters
from kvpool.errors import PoolClosedError
from kvpool.keys import Namespace
from kvpool.tiers.base import Tier, read_tiers
from kvpool.tiers.dram import DramTier
from kvpool.tiers.slots import SlotReservation

log = logging.getLogger("kvpool.pool")


class Mover:
    """``counters`` gets prefetched / promotions (chunks moved up) and *_skipped (jobs not
    queued). A prefetch's reads count as the tiers' hits (``<tier>_hits``: it reads for the
    load that follows, which then finds the chunks in DRAM); a promotion's do not (the read
    that asked for it was counted already)."""

    def __init__(self, front: DramTier, lower: Sequence[Tier], counters: Counters,
                 max_pending: int, batch: int) -> None:
        self._front = front
        self._lower = list(lower)
        self._counters = counters
        self._max_pending = max_pending
        self._batch = batch
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._epoch = 0  # bumped by every removal: see removing()
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
        with self._lock:
            if self._closed:
                return None
            if self._pending >= self._max_pending:
                self._counters.add(skipped)
                return None
            self._pending += 1
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvpool-mover")
            return self._executor.submit(self._job, ns, todo, counter, count_hits)

    def _job(self, ns: Namespace, keys: list[bytes], counter: str, count_hits: bool) -> int:
        moved = 0
        add = self._counters.add if count_hits else _uncounted
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

    def _move(self, ns: Namespace, keys: list[bytes], add: Callable[[str, int], None]) -> int:
        slots: list[SlotReservation] = []
        wanted: list[bytes] = []
        epoch = self._epoch  # a delete or invalidation from here on voids this move
        try:
            for key in keys:
                slot = self._front.reserve(key, ns, ns.chunk_bytes, on_lower=True)
                if isinstance(slot, SlotReservation):  # True: already there; False: no room
                    slots.append(slot)
                    wanted.append(key)
            served = read_tiers(self._lower, ns, wanted, [s.view for s in slots], add)
            moved = 0
            with self._publish:  # no removal runs between the check and the publish
                if self._epoch == epoch:
                    for slot, tier in zip(slots, served, strict=True):
                        if tier >= 0:
                            moved += slot.commit()
            return moved
        finally:
            for slot in slots:
                slot.abort()  # the misses (a no-op for the committed ones)

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


def _uncounted(name: str, n: int) -> None:
    pass
