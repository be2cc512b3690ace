"""Worker side: copy whole KV pages between vLLM's blocks and the pool (no vLLM imports).

This process owns the embedded :class:`~kvpool.pool.KVPool` (see ``lookup.py`` for why) and
serves the scheduler's lookups.

* **Load** (``start_load``): a background job reads every chunk of the step's loads from the
  pool (DRAM-resident chunks are pinned and read in place, the rest read into staging, SSD
  reads in parallel and checksummed). ``wait_layer`` waits for those reads, then copies only
  its own layer's pages, right before that layer's attention: layer l never waits for the
  copies of layer l+1. (The copies run on the engine's thread: on CPU a copy thread would
  only contend for the same cores and the GIL; on an accelerator they are one host-to-device
  copy per chunk and layer.) A chunk that misses or fails its checksum fails from there to
  the end of its request: those blocks are reported by ``take_load_errors`` and vLLM
  recomputes them, and the request's saves in that step are dropped (they would hold KV
  computed on top of a bad prefix).
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
import time
import warnings
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
from kvpool.integrations.vllm.plan import ReqTransfer
from kvpool.integrations.vllm.settings import ConnectorSettings
from kvpool.integrations.vllm.stats import StatsWriter
from kvpool.keys import Namespace
from kvpool.pool import KVPool
from kvpool.ssd.directio import aligned_buffer
from kvpool.tiers.dram import PinnedView

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


class _Fetched:
    """A step's loads once read: per chunk (pages, source page index or None for all,
    destination blocks), plus the pins and staging buffers to release after the copies."""

    def __init__(self) -> None:
        self.copies: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
        self.pins: list[PinnedView | None] = []
        self.bufs: list[np.ndarray] = []


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
        self._fetch: Future[_Fetched] | None = None
        self._fetch_result: _Fetched | None = None
        self._copied: list[bool] = []
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
        # The load follows within a step or two: start lifting SSD / remote hits into DRAM
        # now, so the load pins them in place instead of reading them then.
        self.pool.prefetch(self.ns, keys[:hits])
        return hits

    def _pages(self, buf: np.ndarray | memoryview) -> torch.Tensor:
        """A chunk buffer (staging array or pinned DRAM slot, never written through) as
        ``[layers, blocks_per_chunk, *page_shape]`` in the KV dtype, without a copy."""
        assert self._geom is not None
        g = self._geom
        with warnings.catch_warnings():  # pinned slots are read-only views; we only read them
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(buf, dtype=torch.uint8)
        return flat.view(g.dtype).view(len(g.layer_names), self.settings.blocks_per_chunk,
                                       *g.page_shape)

    # ---------------------------------------------------------------- loads
    def start_load(self, loads: Sequence[ReqTransfer]) -> None:
        """Start reading this step's chunks from the pool (background job)."""
        self._finish_load()
        if not loads or self.ns is None:
            return
        self._copied = [False] * len(self._layer_pos)
        self._fetch = self._loader.submit(self._fetch_job, list(loads))

    def _fetch_job(self, loads: list[ReqTransfer]) -> _Fetched:
        """Read every chunk (DRAM-resident ones pinned in place, the rest into staging), then
        decide per request how far its load is good. Never raises: faults become failed
        blocks."""
        assert self.ns is not None and self._bufs is not None
        fetched = _Fetched()
        chunks = [c for r in loads for c in r.chunks]
        keys = [c.keys[self.tp_rank] for c in chunks]
        sources: list[torch.Tensor | None] = [None] * len(chunks)
        try:
            fetched.pins = self.pool.pin_many(self.ns, keys)
            for i, pin in enumerate(fetched.pins):
                if pin is not None:
                    sources[i] = self._pages(pin.data)
            rest = [i for i, pin in enumerate(fetched.pins) if pin is None]
            fetched.bufs = [self._bufs.take() for _ in rest]
            got = self.pool.get_many_into(self.ns, [keys[i] for i in rest], fetched.bufs) \
                if rest else []
            for i, buf, hit in zip(rest, fetched.bufs, got, strict=True):
                if hit:
                    sources[i] = self._pages(buf)
        except Exception:
            log.exception("kvpool load failed; the blocks will be recomputed")
            sources = [None] * len(chunks)
        i = 0
        bad_chunks = bad_blocks = loaded_tokens = 0
        for req in loads:
            failed = False
            for chunk in req.chunks:
                src = sources[i]
                i += 1
                if failed or src is None:
                    failed = True
                    bad_chunks += 1
                    ids = [b for b in chunk.block_ids if b >= 0]
                    bad_blocks += len(ids)
                    self._load_errors.update(ids)
                    self._failed_reqs.add(req.req_id)
                    continue
                pos = [j for j, b in enumerate(chunk.block_ids) if b >= 0]
                src_idx = None if len(pos) == len(chunk.block_ids) \
                    else torch.tensor(pos, dtype=torch.long)
                dst_idx = torch.tensor([chunk.block_ids[j] for j in pos], dtype=torch.long)
                fetched.copies.append((src, src_idx, dst_idx))
                loaded_tokens += len(pos) * self.settings.block_size
        self.stats.add(loaded_tokens=loaded_tokens, loaded_chunks=len(fetched.copies),
                       load_failed_chunks=bad_chunks, load_failed_blocks=bad_blocks)
        return fetched

    def _fetched(self) -> _Fetched | None:
        if self._fetch is not None and self._fetch_result is None:
            self._fetch_result = self._fetch.result()
        return self._fetch_result

    def _copy_layer(self, fetched: _Fetched, pos: int) -> None:
        if self._copied[pos]:
            return
        self._copied[pos] = True
        assert self._geom is not None
        kv = self._kv[self._geom.layer_names[pos]]
        for pages, src_idx, dst_idx in fetched.copies:
            src = pages[pos] if src_idx is None else pages[pos].index_select(0, src_idx)
            if kv.device != src.device:  # accelerator: one host-to-device copy
                src, dst_idx = src.to(kv.device), dst_idx.to(kv.device)
            kv.index_copy_(0, dst_idx, src)

    def wait_layer(self, layer_name: str) -> None:
        """Wait for the reads, then copy this layer's pages (just before its attention)."""
        if self._fetch is None:
            return
        start = time.perf_counter()
        pos = self._layer_pos.get(layer_name)
        fetched = self._fetched()
        if pos is not None and fetched is not None:
            self._copy_layer(fetched, pos)
        self.stats.add(load_wait_us=int((time.perf_counter() - start) * 1e6))

    def _finish_load(self) -> None:
        """Copy layers no attention asked for, release pins and staging."""
        fetched = self._fetched()
        self._fetch, self._fetch_result = None, None
        if fetched is None:
            return
        assert self._bufs is not None
        try:
            for pos in range(len(self._copied)):
                self._copy_layer(fetched, pos)
        finally:
            for pin in fetched.pins:
                if pin is not None:
                    pin.release()
            for buf in fetched.bufs:
                self._bufs.give(buf)

    def take_load_errors(self) -> set[int]:
        self._finish_load()
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---------------------------------------------------------------- saves
    def save_layer(self, layer_name: str, kv_layer: torch.Tensor,
                   stores: Sequence[ReqTransfer]) -> None:
        pos = self._layer_pos.get(layer_name)
        if pos is None or not stores or self._bufs is None:
            return
        start = time.perf_counter()
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
        self.stats.add(save_gather_us=int((time.perf_counter() - start) * 1e6))

    def _begin_saves(self, stores: Sequence[ReqTransfer]) -> None:
        assert self._bufs is not None and self.ns is not None
        self._fetched()  # a failed load must be known before its request's saves
        self._drop_pending()
        dropped = 0
        for req in stores:
            if req.req_id in self._failed_reqs:
                dropped += len(req.chunks)
                continue
            for chunk in req.chunks:
                if self.pool.contains(self.ns, chunk.keys[self.tp_rank]):
                    continue  # already stored (e.g. a prompt's last full chunk on a hit)
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
        self._finish_load()
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
        self._finish_load()
        self._put_queue.put(None)
        self._putter.join()
        self._loader.shutdown(wait=True)
        if self.server is not None:
            self.server.close()
        try:
            self.stats.write(self.pool.stats(), force=True)
        finally:
            self.pool.close()

