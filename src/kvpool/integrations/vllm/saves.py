"""The save side of the vLLM worker: the layer-by-layer gather over ``KVPool.begin_save``
(no vLLM imports).

At layer 0 every request's chunks to store get DRAM slots from the pool
(``KVPool.begin_save``: never waiting; no slot, or over ``pool.save_budget_bytes``, is a
counted drop); right after each layer's attention wrote its KV, its pages are gathered
straight into those slots (the one copy between the engine and the pool). ``end_step``
commits each request's batch (``SaveBatch.commit``): the pool's save thread publishes it, so
inference never waits for a slow tier, and the chunks count for lookups at once, a load of
them waiting for their commit (the pool's read-your-writes, ``pool.save_commit_wait_s``).
A request's retention is recorded on that save thread too, right before its chunks are
published (with storage nodes: a RETAIN per node), and a session's end follows the saves
handed over before it there (a RELEASE per node): the engine's step never waits on a node.

Failure contract: never raises into the engine for pool faults; a failed commit is a counted
drop (and a load waiting for it then misses, so vLLM recomputes).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial

import torch

from kvpool.host.client import AttachedPool
from kvpool.integrations.retention import retain_for_save, retention_now
from kvpool.integrations.vllm.plan import ReqTransfer
from kvpool.integrations.vllm.stats import StatsWriter
from kvpool.keys import Namespace
from kvpool.pool import KVPool
from kvpool.retention import Retention
from kvpool.saves import SaveBatch, SaveTicket

log = logging.getLogger("kvpool.integrations.vllm")


class _PendingSave:
    """One request's chunks being gathered into their slots: ``pages[i]`` holds chunk i's
    engine block ids (None where ``batch.views[i]`` is None), ``layers`` how many are in;
    ``retention`` what the request asks its chunks to be kept for (recorded on the pool's
    save thread, right before they are published)."""

    __slots__ = ("batch", "layers", "pages", "req_id", "retention")

    def __init__(self, req_id: str, batch: SaveBatch, pages: list[torch.Tensor | None],
                 retention: Retention | None) -> None:
        self.req_id, self.batch, self.pages = req_id, batch, pages
        self.retention = retention
        self.layers = 0


class Saves:
    """``pages_of(view)`` shows a chunk buffer as ``[layers, blocks_per_chunk, *page_shape]``."""

    def __init__(self, pool: KVPool | AttachedPool, ns: Namespace, tp_rank: int, stats: StatsWriter,
                 pages_of: Callable[[memoryview], torch.Tensor]) -> None:
        self.pool, self.ns, self.tp_rank, self.stats = pool, ns, tp_rank, stats
        self._pages_of = pages_of
        self._pending: list[_PendingSave] = []  # being gathered this step
        self._tickets: list[SaveTicket] = []  # committed, not yet counted

    # ---------------------------------------------------------------- during the step
    def begin(self, stores: Sequence[ReqTransfer], failed_reqs: set[str]) -> None:
        """Layer 0: reserve a slot per chunk to store (requests whose load failed are dropped:
        their KV would sit on a bad prefix)."""
        self.drop_pending()
        dropped = 0
        for req in stores:
            if req.req_id in failed_reqs:
                dropped += len(req.chunks)
                continue
            keys = [c.keys[self.tp_rank] for c in req.chunks]
            # TTL and pin deadlines count from now; recorded at the commit (``_retain``)
            retention = retention_now(req.retention) if req.retention else None
            batch = self.pool.begin_save(self.ns, keys)
            # held: already stored (a prompt's last chunk) or on its way
            dropped += sum(v is None and not h for v, h in zip(batch.views, batch.held,
                                                                strict=True))
            if batch.reserved or retention is not None:  # stored chunks get it too
                pages = [torch.tensor(c.block_ids, dtype=torch.long) if v is not None else None
                         for c, v in zip(req.chunks, batch.views, strict=True)]
                self._pending.append(_PendingSave(req.req_id, batch, pages, retention))
        if dropped:
            self.stats.add(dropped_chunks=dropped)

    def gather(self, pos: int, kv: torch.Tensor) -> None:
        """Copy layer ``pos`` of every pending chunk from the engine's blocks ``kv``."""
        for p in self._pending:
            if p.layers != pos:
                continue
            for view, ids in zip(p.batch.views, p.pages, strict=True):
                if view is None or ids is None:
                    continue
                dst = self._pages_of(view)[pos]  # this layer's slice of the slot
                if kv.device == dst.device:
                    torch.index_select(kv, 0, ids, out=dst)
                else:  # accelerator: gather on the device, then one device-to-host copy
                    dst.copy_(kv.index_select(0, ids.to(kv.device)))
            p.layers += 1

    def end_step(self, layers: int, failed_reqs: set[str]) -> None:
        """Commit every request gathered for all ``layers`` (visible to lookups from now on);
        drop the rest. Never waits for the pool."""
        dropped = 0
        for p in self._pending:
            if p.layers == layers and p.req_id not in failed_reqs:
                before = None if p.retention is None \
                    else partial(self._retain, p.batch.keys, p.retention)
                self._tickets.append(p.batch.commit(before))
            else:
                dropped += p.batch.reserved
                p.batch.abort()
        self._pending = []
        if dropped:
            self.stats.add(dropped_chunks=dropped)
        self._count()

    def _retain(self, keys: list[bytes], retention: Retention) -> None:
        """On the pool's save thread, before the chunks are published: record their
        retention (with storage nodes a RETAIN per node, which the engine's step never waits
        for). A refused pin is counted; the chunks are saved unpinned."""
        if not retain_for_save(self.pool, self.ns, keys, retention):
            self.stats.add(pins_refused=1)

    def drop_pending(self) -> None:
        dropped = sum(p.batch.reserved for p in self._pending)
        for p in self._pending:
            p.batch.abort()
        if dropped:
            self.stats.add(dropped_chunks=dropped)
        self._pending = []

    def _count(self, wait: bool = False) -> None:
        """Count the commits that ran (all, waiting, with ``wait``)."""
        left = []
        stored = dropped = 0
        for ticket in self._tickets:
            if wait:
                ticket.wait()
            if not ticket.done():
                left.append(ticket)
                continue
            handed = sum(ticket.taken) - ticket.present
            stored += ticket.stored
            dropped += handed - ticket.stored
        self._tickets = left
        if stored or dropped:
            self.stats.add(stored_chunks=stored, dropped_chunks=dropped)

    def release(self, sessions: Sequence[tuple[str, bool]]) -> None:
        """End ``sessions`` (KVPool.release, with storage nodes a RELEASE per node) on the
        pool's save thread, once the saves committed before have landed (its queue is in
        order): the step never waits for it. A failed release is logged."""
        if not sessions:
            return
        end = partial(self._end_sessions, list(sessions))
        self._tickets.append(self.pool.begin_save(self.ns, []).commit(end))

    def _end_sessions(self, sessions: list[tuple[str, bool]]) -> None:
        for session, delete in sessions:
            try:
                self.pool.release(session, delete)
            except Exception:
                log.exception("kvpool: releasing session %r failed", session)
                continue
            self.stats.add(sessions_released=1)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every chunk committed so far landed (the pool's save thread); False on
        timeout."""
        if not all(t.wait(timeout) for t in self._tickets):
            return False
        self._count()
        return True

    def close(self) -> None:
        """Drop what is being gathered; the pool's close commits what was handed over."""
        self.drop_pending()
