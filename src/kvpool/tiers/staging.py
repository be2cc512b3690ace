"""Bounded write-behind to a slower tier (the SSD engine, or the storage-node cluster): a tier
of its own, placed above the tier it feeds, so a pool reads staged chunks like any other.

``offer`` (``put_many``) copies a chunk into a staging buffer (a large copy with the GIL
released: ``buffers.copy_into``) and returns at once; ``offer_pinned`` instead queues a pinned
DRAM slot that holds the chunk (no copy: the SSD writes straight from the slot, which stays
out of eviction until written), within ``max_pinned`` bytes; a worker
thread writes staged chunks to the sink in batches. When the staged bytes would exceed the
budget the offer is refused and counted as a dropped save: the caller (inference) never waits
for the SSD. Staged chunks are readable (``get_into``) until written, so a just-evicted chunk
is not a miss.

With ``writers`` > 1 (the SSD's queue: ``pool.write_behind_threads``) several worker threads
write batches at once, so the disk is not idle while a worker hashes its batch, indexes the
last one or waits for a core: on a loaded 2-core machine one writer left the disk idle between
its writes for most of the time. The batches still reach the log in the order they were taken:
a worker hands its batch to the sink only after the previous batch has its place in the log
(the sink's ``reserved`` callback), then hashes and writes it while the next one is placed.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

from kvpool.buffers import byte_view, copy_into
from kvpool.errors import PoolClosedError
from kvpool.keys import Namespace
from kvpool.logs import RateLimited
from kvpool.priority import lower_thread_priority
from kvpool.ssd.directio import aligned_buffer
from kvpool.tiers.base import Item, local_lookup
from kvpool.tiers.slots import PinnedView

log = logging.getLogger("kvpool.writebehind")


@dataclass(slots=True)
class _Staged:
    ns: Namespace
    buffer: memoryview  # page-aligned, so the SSD write is zero-copy from here
    nbytes: int
    pin: PinnedView | None = None  # the DRAM slot ``buffer`` views, released once written


class BatchSink(Protocol):
    """Where staged chunks go: ``put_many`` returns how many it stored and may raise."""

    def put_many(self, items: Iterable[tuple[bytes, Namespace, Any]]) -> int: ...


class OrderedSink(Protocol):
    """A sink that several writers may feed at once: ``put_many`` calls ``reserved`` once the
    whole batch has its place (the SSD engine: at the log head), before its slow part."""

    def put_many(self, items: Iterable[tuple[bytes, Namespace, Any]], *,
                 reserved: Callable[[], object] | None = None) -> int: ...


class WriteBehind:
    """``label`` names the sink in thread names and logs (and the tier, ``<label>_staging``,
    in metrics); ``stats_key`` places the stats. The SSD's queue counts its hits as
    ``staged_hits``, another's as ``<label>_staged_hits``. ``writers`` > 1 needs an
    ``OrderedSink`` (raises ValueError below 1)."""

    def __init__(self, sink: BatchSink | OrderedSink, max_bytes: int, batch: int = 16,
                 label: str = "ssd", stats_key: tuple[str, ...] = ("write_behind",),
                 nice: int = 0, max_pinned: int = 0, writers: int = 1) -> None:
        if writers < 1:
            raise ValueError(f"writers must be at least 1, got {writers}")
        self._sink = sink
        self._nice = nice
        self._name = label
        self.name = "staged" if label == "ssd" else f"{label}_staged"
        self.label = f"{label}_staging"
        self.stats_key = stats_key
        self._max_bytes = max_bytes
        #: Bytes of pinned DRAM slots the queue may hold (``offer_pinned``; 0: never).
        self.max_pinned = min(max_pinned, max_bytes)
        self._pinned = 0
        self._releasing = 0  # workers releasing the pins of a written batch
        self._taken = 0  # batches taken from the queue so far (a batch's ticket)
        self._turn = 0  # the ticket whose batch may go to the sink next (writers > 1)
        self._batch = batch
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue: OrderedDict[bytes, _Staged] = OrderedDict()
        self._writing: dict[bytes, _Staged] = {}
        self._spare: defaultdict[int, list[memoryview]] = defaultdict(list)
        self._allocated = 0
        self._closed = False
        self._drops_said = RateLimited()
        #: Called by the worker after each batch it wrote, before ``flush`` sees the batch
        #: done (the pool writes back, from DRAM, what the SSD's log dropped meanwhile); its
        #: errors are logged, never raised.
        self.after_batch: Callable[[], object] | None = None
        self._counters = dict.fromkeys(("offered", "offered_bytes", "offered_pinned",
                                        "written", "dropped", "write_errors"), 0)
        self._workers = [threading.Thread(target=self._run, daemon=True,
                                          name=f"kvpool-write-behind-{label}"
                                               + (f"-{i}" if writers > 1 else ""))
                         for i in range(writers)]
        for worker in self._workers:
            worker.start()

    def _take_buffer(self, nbytes: int) -> memoryview | None:
        size = (nbytes + 4095) // 4096 * 4096
        spares = self._spare[size]
        if spares:
            return spares.pop()
        if self._allocated + size > self._max_bytes:
            # Reuse memory parked for other sizes before refusing.
            for other, bufs in self._spare.items():
                while bufs and self._allocated + size > self._max_bytes:
                    bufs.pop()
                    self._allocated -= other
            if self._allocated + size > self._max_bytes:
                return None
        self._allocated += size
        return memoryview(aligned_buffer(size))

    def offer(self, key: bytes, ns: Namespace, data: Any) -> bool:
        """Stage a copy of ``data`` for the sink. False (counted as dropped) if the staging
        budget is full; True if staged or already staged. Raises PoolClosedError after close."""
        view = byte_view(data)
        with self._lock:
            if self._closed:
                raise PoolClosedError("write-behind queue is closed")
            if key in self._queue or key in self._writing:
                return True
            buf = self._take_buffer(view.nbytes)
            if buf is not None:
                self._counters["offered"] += 1
                self._counters["offered_bytes"] += view.nbytes
            else:
                self._counters["dropped"] += 1
        if buf is None:
            self._say_dropped()  # outside the lock: the queue's users never wait on a log
            return False
        copy_into(buf, view)  # a large copy releases the GIL: no other thread waits
        with self._lock:
            self._queue[key] = _Staged(ns, buf, view.nbytes)
            self._cond.notify_all()
        return True

    def offer_pinned(self, key: bytes, ns: Namespace, pin: PinnedView) -> bool | None:
        """Queue the DRAM slot ``pin`` holds for the sink, without a copy: the queue owns the
        pin from here (released once written or discarded). True if queued or already
        queued (``pin`` released); None when the pinned bytes would exceed ``max_pinned`` or
        the staging budget: nothing is counted and ``pin`` stays the caller's, who offers a
        copy (``offer``) and releases it. Raises PoolClosedError after close (``pin``
        released)."""
        nbytes = pin.data.nbytes
        with self._lock:
            taken = not self._closed and key not in self._queue and key not in self._writing \
                and self._pinned + nbytes <= self.max_pinned \
                and self._allocated + self._pinned + nbytes <= self._max_bytes
            if taken:
                self._pinned += nbytes
                self._counters["offered"] += 1
                self._counters["offered_pinned"] += 1
                self._counters["offered_bytes"] += nbytes
                self._queue[key] = _Staged(ns, pin.data, nbytes, pin)
                self._cond.notify_all()
                return True
            closed, queued = self._closed, key in self._queue or key in self._writing
        if not (closed or queued):
            return None
        pin.release()
        if closed:
            raise PoolClosedError("write-behind queue is closed")
        return True

    def _recycle(self, staged: _Staged) -> None:
        """Give a written or discarded chunk's memory back (lock held); a pin is released by
        the caller after the lock (``_release``)."""
        if staged.pin is None:
            self._spare[len(staged.buffer)].append(staged.buffer)
        else:
            self._pinned -= staged.nbytes

    @staticmethod
    def _release(staged: Sequence[_Staged]) -> None:
        for s in staged:
            if s.pin is not None:
                s.pin.release()

    def _say_dropped(self) -> None:
        """One WARNING per burst of drops (RateLimited), naming how many were held back."""
        held = self._drops_said.due()
        if held is not None:
            log.warning("write-behind (%s): staging full (%d bytes), saves dropped%s",
                        self._name, self._max_bytes,
                        f" ({held + 1} since the last report)" if held else "",
                        extra={"event": "dropped_save", "queue": self.label, "cause": "full",
                               "dropped": held + 1})

    def put_many(self, items: Sequence[Item]) -> list[bool]:
        return [self.offer(key, ns, view) for key, ns, view in items]

    def register_namespace(self, ns: Namespace) -> None:
        pass  # staging holds chunks of any size that its sink accepts

    def _find(self, key: bytes, namespace_id: bytes | None) -> _Staged | None:
        """The staged chunk, if any (and, given ``namespace_id``, only if it was staged
        under that namespace); lock held."""
        staged = self._queue.get(key) or self._writing.get(key)
        if staged is None or (namespace_id is not None and staged.ns.id != namespace_id):
            return None
        return staged

    def get_into(self, key: bytes, out: memoryview, namespace_id: bytes | None = None) -> bool:
        """Copy a staged chunk into ``out``. False if none is staged (under
        ``namespace_id``, when given) or its size differs from ``out``'s."""
        with self._lock:
            staged = self._find(key, namespace_id)
            if staged is None or staged.nbytes != out.nbytes:
                return False
            out[:] = staged.buffer[:staged.nbytes]
            return True

    def get_many_into(self, ns: Namespace, keys: Sequence[bytes],
                      outs: Sequence[memoryview]) -> list[bool]:
        return [self.get_into(key, out, ns.id) for key, out in zip(keys, outs, strict=True)]

    def lookup(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        return local_lookup(self.contains_many, keys, ns.id)

    def touch_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [False] * len(keys)  # staged chunks leave soon: recency means nothing here

    def contains(self, key: bytes, namespace_id: bytes | None = None) -> bool:
        with self._lock:
            return self._find(key, namespace_id) is not None

    def contains_many(self, keys: Sequence[bytes], namespace_id: bytes) -> list[bool]:
        """``contains`` for a batch, under one lock acquisition."""
        with self._lock:
            return [self._find(k, namespace_id) is not None for k in keys]

    def discard(self, key: bytes) -> None:
        """Forget a staged chunk (deleted by the user) so it is not written."""
        with self._lock:
            staged = self._queue.pop(key, None)
            if staged is not None:
                self._recycle(staged)
        if staged is not None:
            self._release([staged])

    def delete(self, key: bytes, ns: Namespace) -> bool:
        """Forget a staged chunk; one already being written lands first, so a tombstone
        the sink writes next follows it. True if it was staged."""
        held = self.contains(key)
        self.discard(key)
        self.flush()
        return held

    def invalidate(self, namespace_id: bytes, ns: Namespace | None) -> int:
        """Forget the namespace's staged chunks (none of them is counted: the sink's
        invalidation counts its own copies), after the ones being written landed."""
        self.discard_namespace(namespace_id)
        self.flush()
        return 0

    def discard_namespace(self, namespace_id: bytes) -> None:
        gone = []
        with self._lock:
            for key in [k for k, s in self._queue.items() if s.ns.id == namespace_id]:
                staged = self._queue.pop(key)
                self._recycle(staged)
                gone.append(staged)
        self._release(gone)

    def _next_turn(self, ticket: int) -> None:
        """The batch of ``ticket`` has its place in the sink (or failed): the next may go."""
        with self._lock:
            if self._turn == ticket:
                self._turn += 1
                self._cond.notify_all()

    def _write(self, batch: list[tuple[bytes, _Staged]], ticket: int) -> tuple[int, int]:
        """Hand ``batch`` to the sink, after the batch taken before it has its place there
        (several writers). Returns (written, failed); never raises."""
        items = [(k, s.ns, s.buffer[:s.nbytes]) for k, s in batch]
        try:
            if len(self._workers) == 1:
                written = self._sink.put_many(items)
            else:
                with self._lock:
                    while self._turn != ticket:
                        self._cond.wait()
                written = cast(OrderedSink, self._sink).put_many(
                    items, reserved=lambda: self._next_turn(ticket))
            return written, len(batch) - written
        except Exception as exc:  # a full or failing disk must not kill the worker
            log.warning("write-behind (%s): write of %d chunks failed: %s", self._name,
                        len(batch), exc)
            return 0, len(batch)
        finally:
            if len(self._workers) > 1:
                self._next_turn(ticket)  # no-op once ``reserved`` was called

    def _run(self) -> None:
        lower_thread_priority(self._nice)  # the engine's threads get the cores first
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue and self._closed:
                    return
                batch: list[tuple[bytes, _Staged]] = []
                while self._queue and len(batch) < self._batch:
                    key, staged = self._queue.popitem(last=False)
                    self._writing[key] = staged
                    batch.append((key, staged))
                ticket, self._taken = self._taken, self._taken + 1
            written, failed = self._write(batch, ticket)
            if self.after_batch is not None:  # before the batch is done: a flush waits for it
                try:
                    self.after_batch()
                except Exception:  # the worker must survive it
                    log.exception("write-behind (%s): after-batch hook failed", self._name)
            with self._lock:
                for key, staged in batch:
                    del self._writing[key]
                    self._recycle(staged)
                self._counters["written"] += written
                self._counters["write_errors"] += failed
                self._releasing += 1
            self._release([staged for _, staged in batch])  # before a flush sees it done
            with self._lock:
                self._releasing -= 1
                self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything staged so far is written. False on timeout."""
        with self._lock:
            return self._cond.wait_for(
                lambda: not self._queue and not self._writing and not self._releasing, timeout)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._counters)
            out.update(queued=len(self._queue) + len(self._writing),
                       queued_bytes=sum(s.nbytes for s in self._queue.values())
                       + sum(s.nbytes for s in self._writing.values()),
                       staging_bytes=self._allocated, staging_limit=self._max_bytes,
                       pinned_bytes=self._pinned)
            return out

    def close(self) -> None:
        """Write everything staged, then stop the worker. Idempotent."""
        with self._lock:
            self._closed = True
            self._cond.notify_all()
        for worker in self._workers:
            worker.join()
