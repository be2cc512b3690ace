"""Worker side: copy whole KV pages between vLLM's blocks and the pool (no vLLM imports).

This process owns the embedded :class:`~kvpool.pool.KVPool` (see ``lookup.py`` for why) and
serves the scheduler's lookups.

* **Load** (``start_load``): a background job makes every chunk of the step's loads readable
  (``KVPool.open_load``: DRAM-resident chunks pinned in place, the rest read into DRAM slots or
  the pool's staging, SSD reads in parallel and checksummed; chunks still being saved waited
  for, ``pool.save_commit_wait_s``). ``wait_layer`` waits for those reads, then copies only its
  own layer's pages, right before that layer's attention: layer l never waits for the copies of
  layer l+1. (The copies run on the engine's thread: on CPU a copy thread running ahead of the
  layers was measured and only contended for the same cores, see ``pages.py``. Into host memory
  they are byte copies, a memcpy per run of blocks; on an accelerator one host-to-device copy
  per chunk and layer.) A chunk that misses or fails its checksum fails from there to the end of
  its request: those blocks are reported by ``take_load_errors`` and vLLM recomputes them, and
  the request's saves in that step are dropped (they would hold KV computed on top of a bad
  prefix).
* **Save** (``save_layer``, ``end_step``): see ``saves.py``: pages are gathered layer by layer
  straight into DRAM slots of ``KVPool.begin_save`` and committed by the pool's save thread;
  a chunk handed over is visible to lookups at once and a load of it waits for its commit
  (the pool's read-your-writes, bounded by ``pool.save_commit_wait_s``).

Failure contract: loads and saves never raise into the engine for pool faults (a failed load
is reported blocks, a failed save a counted drop). Misuse raises: ValueError from
``register`` for KV layouts kvpool cannot copy page-wise.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from kvpool.host import open_pool
from kvpool.host.client import AttachedPool
from kvpool.integrations.vllm.layout import (
    EngineIdentity,
    PageGeometry,
    make_namespace,
)
from kvpool.integrations.vllm.lookup import LookupServer
from kvpool.integrations.vllm.pages import (
    HostPageMap,
    PageMap,
    host_page_map,
    host_pages,
    load_host_pages,
    load_pages,
    page_map,
)
from kvpool.integrations.vllm.plan import ReqTransfer
from kvpool.integrations.vllm.saves import Saves
from kvpool.integrations.vllm.settings import ConnectorSettings
from kvpool.integrations.vllm.stats import StatsWriter
from kvpool.keys import Namespace
from kvpool.metrics.engine import EngineCollector
from kvpool.pool import KVPool
from kvpool.saves import LoadHandle

log = logging.getLogger("kvpool.integrations.vllm")


class _Fetched:
    """A step's loads once read: per chunk (its pages ``[layers, pages, *page_shape]``, where
    they go among the engine's blocks) for torch copies, or the same as bytes (``[layers,
    pages, page_bytes]`` uint8) for byte copies into host memory, plus the pool's load handle
    to release after the copies."""

    def __init__(self) -> None:
        self.copies: list[tuple[torch.Tensor, PageMap]] = []
        self.host_copies: list[tuple[np.ndarray, HostPageMap]] = []
        self.handle: LoadHandle | None = None


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, ident: EngineIdentity, tp_rank: int,
                 tp_size: int, num_blocks: int | None = None) -> None:
        self.settings = settings
        self.num_blocks = num_blocks
        self.ident = ident
        self.tp_rank, self.tp_size = tp_rank, tp_size
        #: Attached to the host's pool with ``host.socket`` in the config, else embedded.
        self.pool: KVPool | AttachedPool = open_pool(settings.pool_config(tp_rank, tp_size))
        window = settings.prefetch_window_tokens
        self._prefetch_chunks = self.pool.config.pool.prefetch_window_chunks if window is None \
            else -(-window // settings.chunk_tokens)
        self.ns: Namespace | None = None
        self.server: LookupServer | None = None
        self._kv: dict[str, torch.Tensor] = {}
        #: The engine's blocks as bytes when every layer's lie in host memory with contiguous
        #: pages (``host_pages``): loads then copy bytes, else torch copies ``_kv``.
        self._host_kv: dict[str, np.ndarray] | None = None
        self._layer_pos: dict[str, int] = {}
        self._geom: PageGeometry | None = None
        stats_path = settings.stats_path
        if stats_path and tp_rank > 0:
            stats_path = f"{stats_path}.tp{tp_rank}"
        self.stats = StatsWriter(stats_path, {"tp_rank": tp_rank, "tp_size": tp_size})
        self.pool.metrics.register(EngineCollector(
            "vllm", lambda: self.stats.engine_counts(settings.chunk_tokens)))
        if self.pool.metrics_url is not None:
            log.info("kvpool: rank %d metrics at %s", tp_rank, self.pool.metrics_url)
        # loads
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvpool-load")
        self._fetch: Future[_Fetched] | None = None
        self._fetch_result: _Fetched | None = None
        self._copied: list[bool] = []
        self._load_errors: set[int] = set()
        self._failed_reqs: set[str] = set()
        self._saves: Saves | None = None  # once registered
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
        host = {name: host_pages(view) for name, view in views.items()}
        self._host_kv = {n: v for n, v in host.items() if v is not None} \
            if all(v is not None for v in host.values()) else None
        self._geom, self.ns = geom, ns
        self._layer_pos = {name: i for i, name in enumerate(geom.layer_names)}
        self._saves = Saves(self.pool, ns, self.tp_rank, self.stats, self._pages)
        self.server = LookupServer(self._lookup)
        self.stats.set_info("namespace", ns.canonical())
        self.stats.write(force=True)
        log.info("kvpool: rank %d/%d namespace %s, %d-byte chunks, lookups at %s",
                 self.tp_rank, self.tp_size, ns.id.hex(), ns.chunk_bytes, self.server.address)
        return ns

    def _lookup(self, keys: list[bytes]) -> int:
        assert self.ns is not None and self._saves is not None
        # The load follows within a step or two: the first prefetch_window chunks found only
        # on SSD / the nodes start moving up into DRAM now (the load waits for that move
        # rather than reading them a second time).
        # (chunks still being saved count: the pool's read-your-writes)
        hits = self.pool.lookup(self.ns, keys, prefetch=self._prefetch_chunks)
        unsaved = sum(self.pool.saving_many(self.ns, keys[:hits])) if hits else 0
        self.stats.add(lookups=1, lookup_chunks=len(keys), lookup_hit_chunks=hits,
                       lookup_unsaved_chunks=unsaved)
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

    def _page_bytes(self, buf: np.ndarray | memoryview) -> np.ndarray:
        """The same chunk buffer as ``[layers, blocks_per_chunk, page_bytes]`` uint8 (read
        only), for byte copies."""
        assert self._geom is not None
        return np.frombuffer(buf, dtype=np.uint8).reshape(
            len(self._geom.layer_names), self.settings.blocks_per_chunk, self._geom.page_bytes)

    # ---------------------------------------------------------------- loads
    def start_load(self, loads: Sequence[ReqTransfer]) -> None:
        """Start reading this step's chunks from the pool (background job)."""
        self._finish_load()
        if not loads or self.ns is None:
            return
        self._copied = [False] * len(self._layer_pos)
        self._fetch = self._loader.submit(self._fetch_job, list(loads))

    def _fetch_job(self, loads: list[ReqTransfer]) -> _Fetched:
        """Make every chunk readable (``KVPool.open_load``), then decide per request how far
        its load is good. Never raises: faults become failed blocks."""
        assert self.ns is not None
        fetched = _Fetched()
        chunks = [c for r in loads for c in r.chunks]
        keys = [c.keys[self.tp_rank] for c in chunks]
        sources: list[torch.Tensor | np.ndarray | None] = [None] * len(chunks)
        try:
            fetched.handle = self.pool.open_load(self.ns, keys)
            for i, view in enumerate(fetched.handle.sources):
                if view is not None:
                    sources[i] = self._pages(view) if self._host_kv is None \
                        else self._page_bytes(view)
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
                if isinstance(src, np.ndarray):
                    fetched.host_copies.append((src, host_page_map(chunk.block_ids)))
                else:
                    fetched.copies.append((src, page_map(chunk.block_ids)))
                loaded_tokens += sum(b >= 0 for b in chunk.block_ids) * self.settings.block_size
        self.stats.add(loaded_tokens=loaded_tokens,
                       loaded_chunks=len(fetched.copies) + len(fetched.host_copies),
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
        name = self._geom.layer_names[pos]
        if self._host_kv is not None:
            blocks = self._host_kv[name]
            for layers, host_where in fetched.host_copies:
                load_host_pages(blocks, layers[pos], host_where)
        kv = self._kv[name]
        for pages, where in fetched.copies:
            load_pages(kv, pages[pos], where)

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
        try:
            for pos in range(len(self._copied)):
                self._copy_layer(fetched, pos)
        finally:
            if fetched.handle is not None:
                fetched.handle.release()

    def take_load_errors(self) -> set[int]:
        self._finish_load()
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---------------------------------------------------------------- saves
    def save_layer(self, layer_name: str, kv_layer: torch.Tensor,
                   stores: Sequence[ReqTransfer]) -> None:
        pos = self._layer_pos.get(layer_name)
        if pos is None or not stores or self._saves is None:
            return
        start = time.perf_counter()
        if pos == 0:
            self._fetched()  # a failed load must be known before its request's saves
            self._saves.begin(stores, self._failed_reqs)
        self._saves.gather(pos, self._kv[layer_name])  # block-first view of ``kv_layer``
        self.stats.add(save_gather_us=int((time.perf_counter() - start) * 1e6))

    def end_step(self) -> None:
        """After the forward: commit every fully gathered request (the pool's save thread);
        drop the rest (a step that skipped layers). Never waits for the pool."""
        self._finish_load()
        if self._saves is not None:
            self._saves.end_step(len(self._layer_pos), self._failed_reqs)
        self._failed_reqs.clear()
        self.stats.write()

    def release(self, sessions: Sequence[tuple[str, bool]]) -> None:
        """End these sessions (session, delete) once the saves handed over before are
        committed, on the committer thread (never waits here)."""
        if self._saves is not None:
            self._saves.release(sessions)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued saves reached the pool and the pool's write-behind drained."""
        if self._saves is not None and not self._saves.flush(timeout):
            return False
        return self.pool.flush(timeout)

    def close(self) -> None:
        """Finish queued saves, close the pool (staged chunks reach the SSD). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._finish_load()
        if self._saves is not None:
            self._saves.close()
        self._loader.shutdown(wait=True)
        if self.server is not None:
            self.server.close()
        try:
            self.stats.write(self.pool.stats(), force=True)
        finally:
            self.stats.close()
            self.pool.close()

