"""The save side of the vLLM worker: reserve, gather layer by layer, commit (no vLLM imports).

At layer 0 a DRAM slot is reserved in the pool for every chunk to store (``reserve_many``,
never waiting: no slot means a counted drop); right after each layer's attention wrote its KV,
its pages are gathered straight into those slots (the one copy between the engine and the
pool). ``end_step`` hands the filled reservations to one background thread that commits them
(``KVPool.commit_many``: published in DRAM, offered to the pool's write-behind, or written and
synced for durable puts), so inference never waits for a slow tier. Reservations not yet
committed are bounded by ``pool.write_behind_bytes``; beyond it a save is dropped and counted.

Read-your-writes: a chunk handed to the committer counts as present for lookups at once
(``extend_run``), and a load of it waits for its commit (``wait_committed``, bounded), so the
request right after the one that stored a prefix never misses because the committer is behind.

Failure contract: never raises into the engine for pool faults; a failed commit is a counted
drop (and a load waiting for it then misses, so vLLM recomputes).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvpool.integrations.retention import retain_for_save, retention_now
from kvpool.integrations.vllm.plan import ReqTransfer
from kvpool.integrations.vllm.stats import StatsWriter
from kvpool.keys import Namespace
from kvpool.pool import ChunkReservation, KVPool

log = logging.getLogger("kvpool.integrations.vllm")


class _PendingSave:
    """One chunk being gathered into its reserved pool slot: ``pages`` holds its engine block
    ids, ``layers`` how many layers are in."""

    __slots__ = ("key", "layers", "pages", "req_id", "retention", "slot")

    def __init__(self, req_id: str, pages: torch.Tensor, slot: ChunkReservation,
                 retention: dict[str, Any] | None = None) -> None:
        self.req_id, self.pages, self.slot, self.key = req_id, pages, slot, slot.key
        self.retention = retention
        self.layers = 0


class _Marker:
    """A commit-queue entry that only signals that everything queued before it was committed."""

    def __init__(self, done: threading.Event) -> None:
        self.done = done


class _Release:
    """A commit-queue entry: end these sessions (session, delete) once what was queued
    before is committed."""

    def __init__(self, sessions: Sequence[tuple[str, bool]]) -> None:
        self.sessions = list(sessions)


class Saves:
    """``pages_of(view)`` shows a chunk buffer as ``[layers, blocks_per_chunk, *page_shape]``."""

    def __init__(self, pool: KVPool, ns: Namespace, tp_rank: int, stats: StatsWriter,
                 pages_of: Callable[[memoryview], torch.Tensor]) -> None:
        self.pool, self.ns, self.tp_rank, self.stats = pool, ns, tp_rank, stats
        self._pages_of = pages_of
        self._budget = pool.config.pool.write_behind_bytes
        self._booked = 0
        self._lock = threading.Lock()
        self._committed = threading.Condition(self._lock)
        self._inflight: dict[bytes, int] = {}  # handed to the committer, not yet committed
        self._pending: list[_PendingSave] = []  # being gathered this step
        self._commits: queue.SimpleQueue[list[_PendingSave] | _Marker | _Release | None] = \
            queue.SimpleQueue()
        self._committer = threading.Thread(target=self._commit_loop, name="kvpool-save",
                                           daemon=True)
        self._committer.start()

    # ---------------------------------------------------------------- during the step
    def begin(self, stores: Sequence[ReqTransfer], failed_reqs: set[str]) -> None:
        """Layer 0: reserve a slot per chunk to store (requests whose load failed are dropped:
        their KV would sit on a bad prefix)."""
        self.drop_pending()
        ns, dropped = self.ns, 0
        for req in stores:
            if req.req_id in failed_reqs:
                dropped += len(req.chunks)
                continue
            with self._lock:
                room = min(len(req.chunks), (self._budget - self._booked) // ns.chunk_bytes)
                self._booked += room * ns.chunk_bytes
            # Never waits: no free slot now (every one pinned) is a dropped save.
            keys = [c.keys[self.tp_rank] for c in req.chunks[:room]]
            for chunk, slot in zip(req.chunks, self.pool.reserve_many(ns, keys, wait=False),
                                   strict=False):
                if isinstance(slot, ChunkReservation):
                    ids = torch.tensor(chunk.block_ids, dtype=torch.long)
                    self._pending.append(_PendingSave(req.req_id, ids, slot, req.retention))
                    continue
                self._unbook(1)
                dropped += slot is not True  # True: already stored (a prompt's last chunk)
            dropped += len(req.chunks) - room
        if dropped:
            self.stats.add(dropped_chunks=dropped)

    def gather(self, pos: int, kv: torch.Tensor) -> None:
        """Copy layer ``pos`` of every pending chunk from the engine's blocks ``kv``."""
        for p in self._pending:
            if p.layers == pos:
                dst = self._pages_of(p.slot.view)[pos]  # this layer's slice of the slot
                if kv.device == dst.device:
                    torch.index_select(kv, 0, p.pages, out=dst)
                else:  # accelerator: gather on the device, then one device-to-host copy
                    dst.copy_(kv.index_select(0, p.pages.to(kv.device)))
                p.layers += 1

    def end_step(self, layers: int, failed_reqs: set[str]) -> None:
        """Hand every chunk gathered for all ``layers`` to the committer (visible to lookups
        from now on); drop the rest. Never waits for the pool."""
        done: list[_PendingSave] = []
        dropped = 0
        for p in self._pending:
            if p.layers == layers and p.req_id not in failed_reqs:
                done.append(p)
            else:
                p.slot.abort()
                dropped += 1
        if dropped:
            self._unbook(dropped)
            self.stats.add(dropped_chunks=dropped)
        self._pending = []
        if done:
            with self._lock:
                for p in done:
                    self._inflight[p.key] = self._inflight.get(p.key, 0) + 1
            self._commits.put(done)

    def drop_pending(self) -> None:
        for p in self._pending:
            p.slot.abort()
        self._unbook(len(self._pending))
        if self._pending:
            self.stats.add(dropped_chunks=len(self._pending))
        self._pending = []

    def _unbook(self, chunks: int) -> None:
        with self._lock:
            self._booked -= chunks * self.ns.chunk_bytes

    # ---------------------------------------------------------------- read-your-writes
    def extend_run(self, keys: Sequence[bytes], start: int) -> int:
        """How many of ``keys[start:]``, from the first, are handed to the committer."""
        with self._lock:
            n = start
            while n < len(keys) and keys[n] in self._inflight:
                n += 1
            return n - start

    def wait_committed(self, keys: Sequence[bytes], timeout: float) -> bool:
        """Wait until none of ``keys`` waits for its commit; False on timeout."""
        with self._lock:
            return self._committed.wait_for(
                lambda: not any(k in self._inflight for k in keys), timeout)

    # ---------------------------------------------------------------- the committer
    def _commit_loop(self) -> None:
        while True:
            batch = self._commits.get()
            if batch is None:
                return
            if isinstance(batch, _Marker):
                batch.done.set()
                continue
            if isinstance(batch, _Release):
                self._release(batch.sessions)
                continue
            try:
                self._retain(batch)
                stored = self.pool.commit_many([p.slot for p in batch])
            except Exception:
                log.exception("kvpool save failed; dropped")
                stored = 0
            finally:
                for p in batch:
                    p.slot.abort()  # a no-op once committed
                self._unbook(len(batch))
                with self._lock:
                    for p in batch:
                        left = self._inflight.pop(p.key) - 1
                        if left:
                            self._inflight[p.key] = left
                    self._committed.notify_all()
            self.stats.add(stored_chunks=stored, dropped_chunks=len(batch) - stored)

    def _retain(self, batch: list[_PendingSave]) -> None:
        """Record each request's retention for its chunks before they are committed (an
        ephemeral chunk must be known as such before it is published)."""
        by_req: dict[str, list[_PendingSave]] = {}
        for p in batch:
            if p.retention:
                by_req.setdefault(p.req_id, []).append(p)
        for saves in by_req.values():
            retention = retention_now(saves[0].retention)
            if not retain_for_save(self.pool, self.ns, [p.key for p in saves], retention):
                self.stats.add(pins_refused=1)

    def release(self, sessions: Sequence[tuple[str, bool]]) -> None:
        """End ``sessions`` after the saves queued so far (KVPool.release)."""
        self._commits.put(_Release(sessions))

    def _release(self, sessions: Sequence[tuple[str, bool]]) -> None:
        for session, delete in sessions:
            try:
                self.pool.release(session, delete)
            except Exception:
                log.exception("kvpool: releasing session %r failed", session)
                continue
            self.stats.add(sessions_released=1)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every chunk handed over so far was committed; False on timeout."""
        done = threading.Event()
        self._commits.put(_Marker(done))
        return done.wait(timeout)

    def close(self) -> None:
        """Drop what is being gathered, commit what was handed over, stop the thread."""
        self.drop_pending()
        self._commits.put(None)
        self._committer.join()
