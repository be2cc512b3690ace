"""The save side of the vLLM worker: the layer-by-layer gather over ``KVPool.begin_save``
(no vLLM imports).

At layer 0 every request's chunks to store get DRAM slots from the pool
(``KVPool.begin_save``: never waiting; no slot, or over ``pool.save_budget_bytes``, is a
counted drop); right after each layer's attention wrote its KV, its pages are gathered
straight into those slots (the one copy between the engine and the pool). ``end_step``
commits each request's batch (``SaveBatch.commit``): the pool's save thread publishes it, so
inference never waits for a slow tier, and the chunks count for lookups at once, a load of
them waiting for their commit (the pool's read-your-writes, ``pool.save_commit_wait_s``).

Failure contract: never raises into the engine for pool faults; a failed commit is a counted
drop (and a load waiting for it then misses, so vLLM recomputes).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from kvpool.host.client import AttachedPool
from kvpool.integrations.retention import retain_for_save, retention_now
from kvpool.integrations.vllm.plan import ReqTransfer
from kvpool.integrations.vllm.stats import StatsWriter
from kvpool.keys import Namespace
from kvpool.pool import KVPool
from kvpool.saves import SaveBatch, SaveTicket

log = logging.getLogger("kvpool.integrations.vllm")


class _PendingSave:
    """One request's chunks being gathered into their slots: ``pages[i]`` holds chunk i's
    engine block ids (None where ``batch.views[i]`` is None), ``layers`` how many are in."""

    __slots__ = ("batch", "layers", "pages", "req_id")

    def __init__(self, req_id: str, batch: SaveBatch, pages: list[torch.Tensor | None]) -> None:
        self.req_id, self.batch, self.pages = req_id, batch, pages
        self.layers = 0


class Saves:
    """``pages_of(view)`` shows a chunk buffer as ``[layers, blocks_per_chunk, *page_shape]``."""

    def __init__(self, pool: KVPool | AttachedPool, ns: Namespace, tp_rank: int, stats: StatsWriter,
                 pages_of: Callable[[memoryview], torch.Tensor]) -> None:
        self.pool, self.ns, self.tp_rank, self.stats = pool, ns, tp_rank, stats
        self._pages_of = pages_of
        self._pending: list[_PendingSave] = []  # being gathered this step
        self._tickets: list[SaveTicket] = []  # committed, not yet counted
        #: sessions to end once the saves committed before were: (those tickets, sessions)
        self._releases: list[tuple[list[SaveTicket], list[tuple[str, bool]]]] = []

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
            if req.retention:  # recorded before the chunks are published
                retention = retention_now(req.retention)
                if not retain_for_save(self.pool, self.ns, keys, retention):
                    self.stats.add(pins_refused=1)
            batch = self.pool.begin_save(self.ns, keys)
            # held: already stored (a prompt's last chunk) or on its way
            dropped += sum(v is None and not h for v, h in zip(batch.views, batch.held,
                                                                strict=True))
            if batch.reserved:
                pages = [torch.tensor(c.block_ids, dtype=torch.long) if v is not None else None
                         for c, v in zip(req.chunks, batch.views, strict=True)]
                self._pending.append(_PendingSave(req.req_id, batch, pages))
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
                self._tickets.append(p.batch.commit())
            else:
                dropped += p.batch.reserved
                p.batch.abort()
        self._pending = []
        if dropped:
            self.stats.add(dropped_chunks=dropped)
        self._count()

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
        self._run_releases()

    def release(self, sessions: Sequence[tuple[str, bool]]) -> None:
        """End ``sessions`` (KVPool.release) once the saves committed so far have landed:
        at once when none is outstanding, else at a later step's count or ``flush``."""
        self._releases.append((list(self._tickets), list(sessions)))
        self._run_releases()

    def _run_releases(self) -> None:
        due = [s for tickets, s in self._releases if all(t.done() for t in tickets)]
        self._releases = [(t, s) for t, s in self._releases if not all(x.done() for x in t)]
        for sessions in due:
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
