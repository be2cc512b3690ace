"""``KVPoolHiCacheStorage``: SGLang's HiCache L3 storage backend on an embedded kvpool.

SGLang's cache controller calls it from three threads (backup, prefetch, prefetch IO):

* ``batch_exists(keys)``: one ``KVPool.lookup`` for the batch (the leading run of pages some
  tier holds, storage nodes asked once per node); the first ``pool.prefetch_window_chunks``
  pages of the run that DRAM lacks start moving up into DRAM at once, so the read that follows
  finds them there;
* ``batch_get_v1(keys, host_indices)``: ``KVPool.open_load`` makes the pages readable in
  place (DRAM slots pinned; pages only the SSD or the nodes hold read into free DRAM slots,
  which is their promotion; what finds no slot read into the pool's staging buffers) and each
  is copied straight into the host pool's memory (``pages.py``: one memmove per piece,
  addresses from ``get_page_buffer_meta``);
* ``batch_set_v1(keys, host_indices)``: ``KVPool.save`` with the page gather as its fill: a
  DRAM slot is reserved per page (never waiting), the page's pieces are gathered straight into
  it, and the pool's save thread commits them (published in DRAM, queued pinned for the SSD,
  or written and synced for durable pools); the pages count for ``batch_exists`` at once and a
  read of one waits for its commit (the pool's read-your-writes).

One SGLang page is one kvpool chunk (see ``layout.py`` for its payload and the namespace). The
legacy calls (``get``/``set``/``batch_get``/``batch_set``/``exists``) store the same bytes:
pages written through either path read back through the other.

Failure contract: no pool fault ever raises into SGLang. A failed or missing page is False
(``batch_get_v1``/``batch_set_v1``/``set``/``exists``) or None (``get``), a failed lookup is
0 pages: the controller then recomputes or skips the backup, as it does for any miss.
Misconfiguration raises at creation (ConfigError for bad extra-config keys or kvpool config,
naming the key) or at registration (ValueError for a host pool kvpool cannot copy).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.observability.metrics_collector import StorageMetrics

from kvpool.counters import Counters
from kvpool.errors import ConfigError
from kvpool.host import open_pool
from kvpool.host.client import AttachedPool
from kvpool.integrations.retention import retain_for_save, retention_now
from kvpool.integrations.sglang.layout import (
    PageGeometry,
    RankIdentity,
    make_namespace,
    page_key,
)
from kvpool.integrations.sglang.pages import PageCopier
from kvpool.integrations.sglang.settings import EXTRA_CONFIG, parse_settings
from kvpool.integrations.torch_dtypes import kv_dtype_name
from kvpool.keys import Namespace
from kvpool.metrics.engine import EngineCollector, EngineCounts
from kvpool.pool import KVPool

log = logging.getLogger("kvpool.integrations.sglang")

COUNTERS = ("lookups", "lookup_pages", "lookup_hit_pages", "get_pages", "get_hit_pages",
            "set_pages", "stored_pages", "failed_set_pages", "errors")


def geometry_of(host: Any) -> PageGeometry:
    """The page geometry of an SGLang MHA host pool. Raises ValueError for other host pools
    (MLA, asymmetric K/V widths, quantized scales) and layouts kvpool does not copy."""
    if type(host).__name__ not in ("MHATokenToKVPoolHost", "HiSparseMHATokenToKVPoolHost") \
            or getattr(host, "v_head_dim", None) != getattr(host, "head_dim", None):
        raise ValueError(f"kvpool copies pages of SGLang's MHA host pool with equal K and V "
                         f"widths; got {type(host).__name__}")
    return PageGeometry(layout=host.layout, dtype=kv_dtype_name(host.dtype),
                        layers=int(host.layer_num), heads=int(host.head_num),
                        head_dim=int(host.head_dim), page_size=int(host.page_size))


class KVPoolHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """Created by SGLang as ``cls(storage_config, kwargs)``; the host pool arrives afterwards
    through ``register_mem_pool_host``. Thread-safe."""

    def __init__(self, storage_config: HiCacheStorageConfig,
                 kwargs: dict[str, Any] | None = None) -> None:
        self.settings = parse_settings(storage_config.extra_config)
        model = self.settings.model_id or storage_config.model_name
        if not model:
            raise ConfigError(f"{EXTRA_CONFIG}.model_id: SGLang gave no model name; set one")
        self.writer = storage_config.is_storage_writer
        self.rank = RankIdentity(
            model=model, tp_rank=storage_config.tp_rank, tp_size=storage_config.tp_size,
            pp_rank=storage_config.pp_rank, pp_size=storage_config.pp_size,
            cp_rank=storage_config.attn_cp_rank, cp_size=storage_config.attn_cp_size,
            is_mla=storage_config.is_mla_model)
        #: Attached to the host's pool with ``host.socket`` in the config, else embedded.
        self.pool: KVPool | AttachedPool = open_pool(
            self.settings.pool_config(storage_config.tp_rank, storage_config.tp_size))
        self.ns: Namespace | None = None
        self._copier: PageCopier | None = None
        self._prefetch = self.pool.config.pool.prefetch_window_chunks
        self._counters = Counters(*COUNTERS)
        self._lock = threading.Lock()
        self._io: dict[str, list[float]] = {"prefetch_pgs": [], "backup_pgs": [],
                                            "prefetch_bandwidth": [], "backup_bandwidth": []}
        self._closed = False
        self.pool.metrics.register(EngineCollector("sglang", self._engine_counts))

    # ---------------------------------------------------------------- set-up
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the host pool and register this rank's namespace. Raises ValueError for a
        host pool kvpool cannot copy page-wise."""
        super().register_mem_pool_host(mem_pool_host)
        geom = geometry_of(mem_pool_host)
        ns = make_namespace(self.rank, geom, self.settings.tenant_salt)
        if ns.chunk_bytes != geom.page_bytes:
            raise ValueError(f"namespace chunks of {ns.chunk_bytes} bytes but pages of "
                             f"{geom.page_bytes}")
        self.pool.register_namespace(ns)
        self._copier = PageCopier(geom)
        self.ns = ns
        log.info("kvpool: SGLang rank tp%d/%d pp%d/%d namespace %s, %d-byte pages (%s)",
                 self.rank.tp_rank, self.rank.tp_size, self.rank.pp_rank, self.rank.pp_size,
                 ns.id.hex(), ns.chunk_bytes, geom.layout)

    def _ready(self) -> Namespace | None:
        return None if self._closed else self.ns

    def _keys(self, ns: Namespace, keys: Sequence[str]) -> list[bytes]:
        return [page_key(ns, k) for k in keys]

    def _engine_counts(self) -> EngineCounts:
        c = self._counters.snapshot()
        page = self.ns.chunk_tokens if self.ns is not None else 0
        return EngineCounts(
            lookup_hit_tokens=c["lookup_hit_pages"] * page,
            lookup_miss_tokens=(c["lookup_pages"] - c["lookup_hit_pages"]) * page,
            prefill_tokens_saved=c["get_hit_pages"] * page,
            stored_tokens=c["stored_pages"] * page)

    def _fault(self, what: str) -> None:
        self._counters.add("errors")
        log.exception("kvpool %s failed; SGLang sees misses", what)

    # ---------------------------------------------------------------- lookups
    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many of ``keys``, from the first, some tier holds (0 on a fault)."""
        ns = self._ready()
        if ns is None or not keys:
            return 0
        try:
            hits = self.pool.lookup(ns, self._keys(ns, keys), prefetch=self._prefetch)
        except Exception:
            self._fault("lookup")
            return 0
        self._counters.add_many({"lookups": 1, "lookup_pages": len(keys),
                                 "lookup_hit_pages": hits})
        return hits

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ---------------------------------------------------------------- v1: host pool pages
    def _pages(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[Sequence[int]]:
        assert self._copier is not None
        page = self._copier.geom.page_size
        if host_indices.numel() != len(keys) * page:
            raise ValueError(f"{host_indices.numel()} host slots for {len(keys)} pages of "
                             f"{page} tokens")
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        return self._copier.page_pointers(ptrs, sizes, len(keys))

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Read pages straight into the host pool at ``host_indices``; per key True if its
        page was read (a miss or fault is False, the slots' contents then unspecified)."""
        ns = self._ready()
        if ns is None or not keys:
            return [False] * len(keys)
        started = time.perf_counter()
        try:
            found = self._get_pages(ns, keys, self._pages(keys, host_indices))
        except Exception:
            self._fault("read")
            found = [False] * len(keys)
        self._account("prefetch", sum(found), ns, started)
        self._counters.add_many({"get_pages": len(keys), "get_hit_pages": sum(found)})
        return found

    def _get_pages(self, ns: Namespace, keys: Sequence[str],
                   pages: list[Sequence[int]]) -> list[bool]:
        assert self._copier is not None
        copier = self._copier
        with self.pool.open_load(ns, self._keys(ns, keys)) as handle:
            for src, page in zip(handle.sources, pages, strict=True):
                if src is not None:
                    copier.scatter(src, page)
            return [src is not None for src in handle.sources]

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store the pages at ``host_indices``; per key True if it was gathered into the pool
        (its commit follows in the background; a failed commit is counted in the pool's
        ``save_dropped_commit``) or already stored; False if dropped (no free slot, over
        ``pool.save_budget_bytes``). A rank that is not its group's writer (MLA) stores
        nothing and reports True."""
        ns = self._ready()
        if ns is None or not keys:
            return [False] * len(keys)
        if not self.writer:
            return [True] * len(keys)
        started = time.perf_counter()
        try:
            done = self._set_pages(ns, keys, self._pages(keys, host_indices))
        except Exception:
            self._fault("write")
            done = [False] * len(keys)
        self._account("backup", sum(done), ns, started)
        return done

    def _set_pages(self, ns: Namespace, keys: Sequence[str],
                   pages: list[Sequence[int]]) -> list[bool]:
        assert self._copier is not None
        gather = self._copier.gather
        kv_keys = self._keys(ns, keys)
        retain_for_save(self.pool, ns, kv_keys, retention_now(self.settings.retention))
        ticket = self.pool.save(ns, kv_keys, lambda i, slot: gather(pages[i], slot))
        done = ticket.taken
        self._counters.add_many({"set_pages": len(keys),
                                 "stored_pages": sum(done) - ticket.present,
                                 "failed_set_pages": done.count(False)})
        return done

    def _account(self, kind: str, pages: int, ns: Namespace, started: float) -> None:
        """SGLang's storage metrics (``get_stats``): pages and GB/s of each read / write."""
        elapsed = time.perf_counter() - started
        with self._lock:
            self._io[f"{kind}_pgs"].append(pages)
            self._io[f"{kind}_bandwidth"].append(
                pages * ns.chunk_bytes / elapsed / 1e9 if elapsed > 0 else 0.0)

    # ---------------------------------------------------------------- legacy: flat pages
    def _flat_view(self, ns: Namespace, tensor: torch.Tensor) -> np.ndarray:
        flat = tensor.detach().contiguous().view(torch.uint8).reshape(-1)
        if flat.numel() != ns.chunk_bytes:
            raise ValueError(f"page tensor of {flat.numel()} bytes, pages {ns.chunk_bytes}")
        out: np.ndarray = flat.numpy()
        return out

    def get(self, key: str, target_location: Any = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        """The page as a flat tensor (read into ``target_location`` if given, a contiguous
        CPU tensor of one page); None on a miss or fault."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        ns = self._ready()
        if ns is None or not keys:
            return [None] * len(keys)
        try:
            targets = [t if t is not None else self.mem_pool_host.get_dummy_flat_data_page()
                       for t in (target_locations or [None] * len(keys))]
            found = self.pool.get_many_into(ns, self._keys(ns, keys),
                                            [self._flat_view(ns, t) for t in targets])
        except Exception:
            self._fault("read")
            return [None] * len(keys)
        self._counters.add_many({"get_pages": len(keys), "get_hit_pages": sum(found)})
        return [t if hit else None for t, hit in zip(targets, found, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        """Store one flat page tensor (``get_data_page(index, flat=True)``); False if it was
        not stored."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store flat page tensors; True only if every one is stored."""
        ns = self._ready()
        if ns is None or not keys or values is None:
            return False
        if not self.writer:
            return True
        try:
            kv_keys = self._keys(ns, keys)
            retain_for_save(self.pool, ns, kv_keys, retention_now(self.settings.retention))
            stored = self.pool.put_many(ns, kv_keys, [self._flat_view(ns, v) for v in values])
        except Exception:
            self._fault("write")
            return False
        self._counters.add_many({"set_pages": len(keys), "stored_pages": stored,
                                 "failed_set_pages": len(keys) - stored})
        return stored == len(keys)

    # ---------------------------------------------------------------- admin
    def clear(self) -> bool:
        """Drop every page of this rank's namespace in every tier; False on a fault."""
        ns = self._ready()
        if ns is None:
            return False
        try:
            self.pool.invalidate(ns)
        except Exception:
            self._fault("clear")
            return False
        return True

    def get_stats(self) -> StorageMetrics:
        """SGLang's storage metrics since the last call (pages and GB/s per read / write)."""
        with self._lock:
            io, self._io = self._io, {k: [] for k in self._io}
        return StorageMetrics(**io)

    def stats(self) -> dict[str, Any]:
        """This backend's counters and the pool's (``KVPool.stats``)."""
        out: dict[str, Any] = {"backend": self._counters.snapshot()}
        if not self._closed:
            out["pool"] = self.pool.stats()
        return out

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the pool's background work (write-behind, moves) drained."""
        return self._closed or self.pool.flush(timeout)

    def close(self) -> None:
        """Close the pool (staged pages reach the SSD). Idempotent; later calls miss."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.pool.close()
