"""Worker side: copy whole KV pages between vLLM's blocks and the pool (no vLLM imports).

This process owns the embedded :class:`~kvpool.pool.KVPool` (see ``lookup.py`` for why) and
serves the scheduler's lookups.

* **Load** (``start_load``): one background job per step fetches every chunk of the step's
  loads from the pool (DRAM, else parallel SSD reads, each verified by checksum), then copies
  the pages into the engine's blocks layer by layer, setting one event per layer.
  ``wait_layer`` waits for its own layer only, so layer l+1 is copied while layer l computes.
  A chunk that misses or fails its checksum fails from there to the end of its request: those
  blocks are reported by ``take_load_errors`` and vLLM recomputes them, and the request's
  saves in that step are dropped (they would hold KV computed on top of a bad prefix).
* **Save** (``save_layer``): right after a layer's attention wrote its KV, its pages of the
  chunks to store are gathered into page-aligned staging buffers (a memory copy; the engine's
  blocks are free to be reused after the step). ``end_step`` hands finished chunks to one
  background thread that puts them into the pool, so inference never waits for a slow tier.
  Staging is bounded by ``save_queue_bytes``: beyond it a save is dropped and counted.

Failure contract: loads and saves never raise into the engine for pool faults (a failed load
is reported blocks, a failed save a counted drop). Misuse raises: ValueError from
``register`` for KV layouts kvpool cannot copy page-wise.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from kvpool.integrations.vllm.layout import (
    EngineIdentity,
    PageGeometry,
    make_namespace,
)
from kvpool.integrations.vllm.lookup import LookupServer
from kvpool.integrations.vllm.plan import ChunkCopy, ReqTransfer
from kvpool.integrations.vllm.settings import ConnectorSettings
from kvpool.integrations.vllm.stats import StatsWriter
from kvpool.keys import Namespace
from kvpool.pool import KVPool
from kvpool.ssd.directio import aligned_buffer

log = logging.getLogger("kvpool.integrations.vllm")

DEFAULT_SAVE_QUEUE_BYTES = 256 << 20


class _Buffers:
    """Reusable page-aligned chunk buffers (O_DIRECT reads land in them without a bounce)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self) -> np.ndarray:
        with self._lock:
            if self._free:
                return self._free.pop()
        return np.frombuffer(aligned_buffer(self.nbytes), np.uint8, self.nbytes)

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            if len(self._free) < 64:
                self._free.append(buf)


class _Marker:
    """A put-queue entry that only signals that everything queued before it was put."""

    def __init__(self, done: threading.Event) -> None:
        self.done = done


class _PendingSave:
    """One chunk being gathered: ``pages`` holds its engine block ids."""

    __slots__ = ("buf", "key", "layers", "pages", "req_id")

    def __init__(self, req_id: str, key: bytes, pages: torch.Tensor, buf: np.ndarray) -> None:
        self.req_id, self.key, self.pages, self.buf = req_id, key, pages, buf
        self.layers = 0


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, ident: EngineIdentity, tp_rank: int,
                 tp_size: int, num_blocks: int | None = None,
                 save_queue_bytes: int = DEFAULT_SAVE_QUEUE_BYTES) -> None:
        self.settings = settings
        self.num_blocks = num_blocks
        self.ident = ident
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.pool = KVPool(settings.pool_config(tp_rank, tp_size))
        self.ns: Namespace | None = None
        self.server: LookupServer | None = None
        self._kv: dict[str, torch.Tensor] = {}
        self._layer_pos: dict[str, int] = {}
        self._geom: PageGeometry | None = None
        self._bufs: _Buffers | None = None
        stats_path = settings.stats_path
        if stats_path and tp_rank > 0:
            stats_path = f"{stats_path}.tp{tp_rank}"
        self.stats = StatsWriter(stats_path, {"tp_rank": tp_rank, "tp_size": tp_size})
        # loads
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvpool-load")
        self._load_future: Future[None] | None = None
        self._layer_events: list[threading.Event] = []
        self._load_errors: set[int] = set()
        self._failed_reqs: set[str] = set()
        # saves
        self._save_budget = save_queue_bytes
        self._save_bytes = 0
        self._save_lock = threading.Lock()
        self._pending: list[_PendingSave] = []
        self._put_queue: queue.SimpleQueue[_PendingSave | _Marker | None] = queue.SimpleQueue()
        self._putter = threading.Thread(target=self._put_loop, name="kvpool-save", daemon=True)
        self._putter.start()
        self._closed = False

    # ---------------------------------------------------------------- set-up
    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> Namespace:
        """Learn the engine's KV tensors, register this rank's namespace, start the lookup
        server. Raises ValueError for KV layouts kvpool cannot copy page-wise."""
        geom, views = PageGeometry.from_kv_caches(kv_caches, self.num_blocks)
        ns = make_namespace(self.ident, geom, self.settings.chunk_tokens, self.tp_rank,
                            self.tp_size, self.settings.tenant_salt)
        self.pool.register_namespace(ns)
        self._kv = views
        self._geom, self.ns = geom, ns
        self._layer_pos = {name: i for i, name in enumerate(geom.layer_names)}
        self._bufs = _Buffers(ns.chunk_bytes)
        self.server = LookupServer(self._lookup)
        self.stats.set_info("namespace", ns.canonical())
        self.stats.write(force=True)
        log.info("kvpool: rank %d/%d namespace %s, %d-byte chunks, lookups at %s",
                 self.tp_rank, self.tp_size, ns.id.hex(), ns.chunk_bytes, self.server.address)
        return ns

    def _lookup(self, keys: list[bytes]) -> int:
        assert self.ns is not None
        hits = self.pool.lookup(self.ns, keys)
        self.stats.add(lookups=1, lookup_hit_chunks=hits)
        return hits

    def _pages(self, buf: np.ndarray) -> torch.Tensor:
        """A chunk buffer as ``[layers, blocks_per_chunk, *page_shape]`` in the KV dtype."""
        assert self._geom is not None
        g = self._geom
        return torch.from_numpy(buf).view(g.dtype).view(
            len(g.layer_names), self.settings.blocks_per_chunk, *g.page_shape)

    # ---------------------------------------------------------------- loads
    def start_load(self, loads: Sequence[ReqTransfer]) -> None:
        self._join_load()
        if not loads or self.ns is None:
            return
        self._layer_events = [threading.Event() for _ in self._layer_pos]
        self._load_future = self._loader.submit(self._load_job, list(loads),
                                                self._layer_events)

    def _load_job(self, loads: list[ReqTransfer], events: list[threading.Event]) -> None:
        assert self.ns is not None and self._bufs is not None and self._geom is not None
        bufs: list[np.ndarray] = []
        try:
            chunks = [c for r in loads for c in r.chunks]
            bufs = [self._bufs.take() for _ in chunks]
            try:
                found = self.pool.get_many_into(self.ns, [c.keys[self.tp_rank] for c in chunks],
                                                bufs)
            except Exception:
                log.exception("kvpool load failed; the blocks will be recomputed")
                found = [False] * len(chunks)
            good: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
            i = 0
            bad_chunks = bad_blocks = loaded_tokens = 0
            for req in loads:
                failed = False
                for chunk in req.chunks:
                    if failed or not found[i]:
                        failed = True
                        bad_chunks += 1
                        ids = [b for b in chunk.block_ids if b >= 0]
                        bad_blocks += len(ids)
                        self._load_errors.update(ids)
                        self._failed_reqs.add(req.req_id)
                    else:
                        good.append(self._copy_plan(chunk, bufs[i]))
                        loaded_tokens += sum(b >= 0 for b in chunk.block_ids) \
                            * self.settings.block_size
                    i += 1
            for pos, name in enumerate(self._geom.layer_names):
                kv = self._kv[name]
                for pages, src_idx, dst_idx in good:
                    src = pages[pos].index_select(0, src_idx)
                    if kv.device != src.device:  # accelerator: one host-to-device copy
                        src, dst_idx = src.to(kv.device), dst_idx.to(kv.device)
                    kv.index_copy_(0, dst_idx, src)
                events[pos].set()
            self.stats.add(loaded_tokens=loaded_tokens, loaded_chunks=len(good),
                           load_failed_chunks=bad_chunks, load_failed_blocks=bad_blocks)
        except Exception:
            log.exception("kvpool load job failed; its blocks will be recomputed")
            for req in loads:
                self._failed_reqs.add(req.req_id)
                for chunk in req.chunks:
                    self._load_errors.update(b for b in chunk.block_ids if b >= 0)
        finally:
            for ev in events:
                ev.set()
            for buf in bufs:
                self._bufs.give(buf)

    def _copy_plan(self, chunk: ChunkCopy,
                   buf: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pos = [j for j, b in enumerate(chunk.block_ids) if b >= 0]
        return (self._pages(buf), torch.tensor(pos, dtype=torch.long),
                torch.tensor([chunk.block_ids[j] for j in pos], dtype=torch.long))

    def wait_layer(self, layer_name: str) -> None:
        pos = self._layer_pos.get(layer_name)
        if pos is not None and pos < len(self._layer_events):
            self._layer_events[pos].wait()

    def _join_load(self) -> None:
        fut, self._load_future = self._load_future, None
        if fut is not None:
            fut.result()  # the job turns its own faults into load errors

    def take_load_errors(self) -> set[int]:
        self._join_load()
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---------------------------------------------------------------- saves
    def save_layer(self, layer_name: str, kv_layer: torch.Tensor,
                   stores: Sequence[ReqTransfer]) -> None:
        pos = self._layer_pos.get(layer_name)
        if pos is None or not stores or self._bufs is None:
            return
        if pos == 0:
            self._begin_saves(stores)
        kv = self._kv[layer_name]  # block-first view of ``kv_layer`` (same memory)
        for p in self._pending:
            if p.layers == pos:
                dst = self._pages(p.buf)[pos]  # this layer's slice of the chunk payload
                if kv.device == dst.device:
                    torch.index_select(kv, 0, p.pages, out=dst)
                else:  # accelerator: gather on the device, then one device-to-host copy
                    dst.copy_(kv.index_select(0, p.pages.to(kv.device)))
                p.layers += 1

    def _begin_saves(self, stores: Sequence[ReqTransfer]) -> None:
        assert self._bufs is not None
        self._drop_pending()
        dropped = 0
        for req in stores:
            if req.req_id in self._failed_reqs:
                dropped += len(req.chunks)
                continue
            for chunk in req.chunks:
                with self._save_lock:
                    ok = self._save_bytes + self._bufs.nbytes <= self._save_budget
                    if ok:
                        self._save_bytes += self._bufs.nbytes
                if not ok:
                    dropped += 1
                    continue
                ids = torch.tensor(chunk.block_ids, dtype=torch.long)
                self._pending.append(_PendingSave(req.req_id, chunk.keys[self.tp_rank], ids,
                                                  self._bufs.take()))
        if dropped:
            self.stats.add(dropped_chunks=dropped)

    def _drop_pending(self) -> None:
        for p in self._pending:
            self._release(p)
        if self._pending:
            self.stats.add(dropped_chunks=len(self._pending))
        self._pending = []

    def _release(self, p: _PendingSave) -> None:
        assert self._bufs is not None
        self._bufs.give(p.buf)
        with self._save_lock:
            self._save_bytes -= self._bufs.nbytes

    def end_step(self) -> None:
        """After the forward: queue every fully gathered chunk for the pool; drop the rest
        (a step that skipped layers). Never waits for the pool."""
        self._join_load()
        complete = len(self._layer_pos)
        for p in self._pending:
            if p.layers == complete and p.req_id not in self._failed_reqs:
                self._put_queue.put(p)
            else:
                self._release(p)
                self.stats.add(dropped_chunks=1)
        self._pending = []
        self._failed_reqs.clear()
        self.stats.write()

    def _put_loop(self) -> None:
        while True:
            p = self._put_queue.get()
            if p is None:
                return
            if isinstance(p, _Marker):
                p.done.set()
                continue
            try:
                assert self.ns is not None
                ok = self.pool.put(self.ns, p.key, p.buf)
            except Exception:
                log.exception("kvpool save failed; dropped")
                ok = False
            self.stats.add(stored_chunks=int(ok), dropped_chunks=int(not ok))
            self._release(p)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued saves reached the pool and the pool's write-behind drained."""
        done = threading.Event()
        self._put_queue.put(_Marker(done))
        if not done.wait(timeout):
            return False
        return self.pool.flush(timeout)

    def close(self) -> None:
        """Finish queued saves, close the pool (staged chunks reach the SSD). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._join_load()
        self._put_queue.put(None)
        self._putter.join()
        self._loader.shutdown(wait=True)
        if self.server is not None:
            self.server.close()
        try:
            self.stats.write(self.pool.stats(), force=True)
        finally:
            self.pool.close()

