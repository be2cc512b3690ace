"""Prefix reuse for Hugging Face transformers causal LMs (DESIGN.md section 7).

For a prompt: build the namespace from the model config, ``lookup`` the longest cached
chunk-aligned prefix, restore it into a DynamicCache (``open_load``), run the model over the
suffix only, and save the new full chunks in the background while generation goes on
(``KVPool.save(defer=True)``: the pool's save thread gathers the cache's K/V straight into
DRAM slots and commits them; read-your-writes is the pool's, so the next prompt sharing the
prefix hits it even while it is being saved). This module holds only the gather and scatter
between the cache tensors and a chunk payload. Chunk payloads are
layer-major (layer 0's K then V, then layer 1 ...), each ``[kv_heads, chunk_tokens, head_dim]``
in the model's dtype, so a layer-wise loader can read one layer as one slice.

Failure contract: the store only accelerates. A miss or a chunk that fails verification
shortens the restored prefix and the model recomputes the rest; a failed save is dropped. The
generated tokens are the model's own either way.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from prometheus_client.registry import CollectorRegistry
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvpool.config import Config
from kvpool.host import open_pool
from kvpool.host.client import AttachedPool
from kvpool.integrations.retention import merged_retention, retain_for_save, retention_now
from kvpool.integrations.torch_dtypes import kv_dtype_name
from kvpool.keys import KVLayout, Namespace
from kvpool.metrics.engine import EngineCollector, EngineCounts
from kvpool.metrics.recorder import LabeledLatency
from kvpool.pool import KVPool
from kvpool.retention import Retention
from kvpool.saves import Fill, LoadHandle, SaveTicket

log = logging.getLogger("kvpool.integrations.hf")


class ChunkStore(Protocol):
    """What the integration needs from a store (KVPool and FilePerChunkPool provide it)."""

    def register_namespace(self, ns: Namespace) -> Namespace: ...

    def lookup(self, ns: Namespace, keys: Sequence[bytes]) -> int: ...

    def save(self, ns: Namespace, keys: Sequence[bytes], fill: Fill, *,
             defer: bool = False) -> SaveTicket: ...

    def open_load(self, ns: Namespace, keys: Sequence[bytes]) -> LoadHandle: ...

    def flush(self, timeout: float | None = None) -> bool: ...


def _attention_layers(cache: DynamicCache) -> list[DynamicLayer]:
    """The cache's layers; raises TypeError for layer kinds whose state is not plain K/V
    (linear attention, ...), which this integration cannot store."""
    layers = list(cache.layers)
    odd = {type(layer).__name__ for layer in layers if not isinstance(layer, DynamicLayer)}
    if odd:
        raise TypeError(f"cache layers of type {sorted(odd)} are not supported; kvpool stores "
                        "full and sliding-window attention K/V")
    return cast(list[DynamicLayer], layers)


def model_shape(model: Any) -> tuple[int, int, int, torch.dtype]:
    """(layers, kv heads, head dim, dtype) of a decoder-only transformers model."""
    cfg = model.config.get_text_config(decoder=True)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, kv_heads, head_dim, model.dtype


def namespace_for(model: Any, chunk_tokens: int = 256, tenant_salt: str = "",
                  model_id: str | None = None, revision: str = "main") -> Namespace:
    """Namespace from the model config: model id, dtype, layers, KV heads, head dim and
    chunk size. Raises ValueError for a dtype kvpool does not store."""
    layers, kv_heads, head_dim, dtype = model_shape(model)
    dtype_name = kv_dtype_name(dtype)
    name = model_id or getattr(model.config, "_name_or_path", "") or type(model).__name__
    layout = KVLayout(dtype=dtype_name, num_layers=layers, num_kv_heads=kv_heads,
                      head_dim=head_dim, chunk_tokens=chunk_tokens,
                      engine_layout="hf:layer-major[k,v][kv_heads,tokens,head_dim]")
    return Namespace(model=name, layout=layout, revision=revision, tenant_salt=tenant_salt)


@dataclass
class Prefill:
    """Result of one prefill: last-position logits, the filled cache and where time went."""

    logits: torch.Tensor
    cache: DynamicCache
    prompt_tokens: int
    cached_tokens: int
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class Generation:
    tokens: list[int]
    ttft_s: float
    total_s: float
    prefill: Prefill


class PrefixCache:
    """Prefill and greedy generation with prefix reuse through a chunk store.

    ``store=None`` is plain recompute (the baseline), with the same code path otherwise.
    ``retention``: what its saves ask to be kept for (docs/retention.md), e.g.
    ``{"priority": "high", "ttl_s": 3600}``; a ``prefill`` / ``generate`` call's own
    ``retention=`` overrides it key by key (a pin the pool refuses is logged and the chunks
    saved unpinned). ArgumentError for a bad one.

    Saving stays off the request that produced the KV: ``generate`` starts the save only once
    the first token is out, so the copies into the store never share the TTFT window; the
    gather runs on the pool's save thread, at ``pool.background_nice`` (Linux), so while it
    overlaps decode steps or the next prefill the engine's threads get the cores first. A
    prefill of chunks still being saved waits for their commit (``pool.save_commit_wait_s``;
    then it recomputes them). ``save_wait_s`` and ``saver_nice`` are deprecated: they became
    those two pool keys, and are ignored with a DeprecationWarning.

    ``metrics`` exports the engine metrics (engine="hf": tokens looked up, loaded, saved;
    TTFT of ``generate``); it is added to the store's registry when the store is a KVPool
    (so its ``metrics.port`` serves them) and removed again by ``close``.
    """

    def __init__(self, model: Any, store: ChunkStore | None, chunk_tokens: int = 256,
                 tenant_salt: str = "", model_id: str | None = None,
                 save_wait_s: float | None = None, saver_nice: int | None = None,
                 retention: Mapping[str, Any] | None = None) -> None:
        for name, value, key in (("save_wait_s", save_wait_s, "pool.save_commit_wait_s"),
                                 ("saver_nice", saver_nice, "pool.background_nice")):
            if value is not None:
                warnings.warn(f"PrefixCache({name}=) is deprecated and ignored: the pool's "
                              f"{key} sets it", DeprecationWarning, stacklevel=2)
        self.model = model
        Retention.from_mapping(retention)  # a bad one fails now
        self.retention = dict(retention) if retention else None
        self.store = store
        self.ns = namespace_for(model, chunk_tokens, tenant_salt, model_id)
        if store is not None:
            store.register_namespace(self.ns)
        self.layers, self.kv_heads, self.head_dim, self.dtype = model_shape(model)
        _attention_layers(DynamicCache(config=model.config))  # fail now, not mid-request
        self._restored: torch.Tensor | None = None
        self._tickets: list[SaveTicket] = []  # saves not yet counted
        self._lock = threading.Lock()
        self.saved_chunks = 0
        self.dropped_saves = 0
        self.lookup_chunks = self.lookup_hit_chunks = self.restored_tokens = 0
        self.ttft = LabeledLatency()
        self.metrics = EngineCollector("hf", self.engine_counts, self.ttft)
        registry = getattr(store, "metrics", None)
        self._registry = registry if isinstance(registry, CollectorRegistry) else None
        if self._registry is not None:
            self._registry.register(self.metrics)
        self._owned: KVPool | AttachedPool | None = None  # a pool ``open`` made: closed here

    @classmethod
    def open(cls, model: Any, config: Config | None = None, **kwargs: Any) -> PrefixCache:
        """A PrefixCache over its own pool, opened with ``kvpool.open_pool(config)``: attached
        to the host's pool when ``host.socket`` is set, else embedded. ``close()`` closes
        that pool. Raises what ``open_pool`` raises (AttachError for a refused attach; a host
        pool not there yet is not an error: misses until it is) and what the constructor
        raises (the pool is closed then)."""
        pool = open_pool(config)
        try:
            cache = cls(model, pool, **kwargs)
        except BaseException:
            pool.close()
            raise
        cache._owned = pool
        return cache

    def engine_counts(self) -> EngineCounts:
        c = self.ns.chunk_tokens
        self._count_saves()
        with self._lock:
            return EngineCounts(
                lookup_hit_tokens=self.lookup_hit_chunks * c,
                lookup_miss_tokens=(self.lookup_chunks - self.lookup_hit_chunks) * c,
                prefill_tokens_saved=self.restored_tokens, stored_tokens=self.saved_chunks * c)

    # ------------------------------------------------------------------ restore
    def reserve(self, tokens: int) -> None:
        """Allocate and touch the restore buffers for prompts of up to ``tokens`` tokens now,
        as engines preallocate their KV memory at start-up; otherwise the first long hit pays
        the page faults of fresh memory (slower than the copies themselves here)."""
        n = -(-tokens // self.ns.chunk_tokens)
        self._restore_target(n).zero_()

    def _restore_target(self, n: int) -> torch.Tensor:
        """[L, 2, 1, H, n*C, D] per-layer contiguous K/V, reused across requests: the first
        forward replaces every layer's tensors (DynamicLayer.update concatenates), so nothing
        keeps pointing at it."""
        c = self.ns.chunk_tokens
        need = self.layers * 2 * self.kv_heads * n * c * self.head_dim
        if self._restored is None or self._restored.numel() < need:
            self._restored = torch.empty(need, dtype=self.dtype)
        return self._restored[:need].view(self.layers, 2, 1, self.kv_heads, n * c,
                                          self.head_dim)

    def restore(self, keys: Sequence[bytes]) -> tuple[DynamicCache | None, int]:
        """Load the longest run of ``keys`` the store can deliver into a fresh DynamicCache.
        Returns (cache or None, restored chunks); a chunk that fails to load ends the run.

        Each chunk is copied once, from where the store holds it (a pinned DRAM slot, or the
        buffer an SSD / node read landed in), into the cache tensors."""
        if self.store is None or not keys:
            return None, 0
        with self.store.open_load(self.ns, keys) as handle:
            n = handle.loaded
            if n == 0:
                return None, 0
            c = self.ns.chunk_tokens
            kv = self._restore_target(n)  # [L, 2, 1, H, n*C, D]: per-layer contiguous K/V
            by_chunk = kv.view(self.layers, 2, self.kv_heads, n, c, self.head_dim)
            stored_shape = (self.layers, 2, self.kv_heads, c, self.head_dim)
            with warnings.catch_warnings():  # the sources are read-only; we only read them
                warnings.simplefilter("ignore", UserWarning)
                for i in range(n):
                    # a temporary: its export of the source ends with the statement, before
                    # the handle is released
                    by_chunk[:, :, :, i].copy_(torch.frombuffer(
                        handle.sources[i], dtype=self.dtype).view(stored_shape))
        cache = DynamicCache(config=self.model.config)
        for layer_idx, layer in enumerate(_attention_layers(cache)):
            keys_t, values_t = kv[layer_idx, 0], kv[layer_idx, 1]
            if getattr(layer, "is_sliding", False):
                layer.update(keys_t, values_t)  # keeps its window and sets cumulative_length
            else:
                layer.lazy_initialization(keys_t, values_t)
                layer.keys, layer.values = keys_t, values_t
        return cache, n

    # ------------------------------------------------------------------ save
    def _gather(self, cache_layers: list[tuple[torch.Tensor, torch.Tensor]],
                first: int) -> Fill:
        """``fill(i, slot)`` for the pool: chunk ``first + i`` of the cache's K/V, layer by
        layer, straight into its slot (the one copy per byte)."""
        c = self.ns.chunk_tokens
        shape = (self.layers, 2, self.kv_heads, c, self.head_dim)

        def fill(i: int, view: memoryview) -> None:
            j = first + i
            dst = torch.frombuffer(view, dtype=self.dtype).view(shape)
            for layer, (k, v) in enumerate(cache_layers):
                dst[layer, 0].copy_(k[0, :, j * c:(j + 1) * c])
                dst[layer, 1].copy_(v[0, :, j * c:(j + 1) * c])
        return fill

    def _count_saves(self, wait: bool = False) -> None:
        """Count the saves whose commit ran (all of them, waiting, with ``wait``)."""
        with self._lock:
            tickets, self._tickets = self._tickets, []
        left = []
        for ticket in tickets:
            if wait:
                ticket.wait()
            if not ticket.done():
                left.append(ticket)
                continue
            saved = ticket.stored + ticket.present
            with self._lock:
                self.saved_chunks += saved
                self.dropped_saves += len(ticket.keys) - saved
        with self._lock:
            self._tickets[:0] = left

    def save_async(self, cache: DynamicCache, keys: Sequence[bytes], first: int,
                   retention: Mapping[str, Any] | None = None) -> None:
        """Hand chunks ``first..len(keys)`` of a filled cache to the store's background save,
        with the engine's retention under ``retention``'s keys. Layers whose cache no
        longer holds every token (sliding windows) make the chunks unsavable: they are
        skipped and counted as dropped. A save the store drops (no room, a failed write)
        is counted as dropped; it never reaches the caller."""
        if self.store is None or first >= len(keys):
            return
        total = len(keys) * self.ns.chunk_tokens
        layers = [(layer.keys, layer.values) for layer in _attention_layers(cache)
                  if layer.keys is not None and layer.values is not None]
        if len(layers) != self.layers or any(k.shape[-2] < total for k, _ in layers):
            with self._lock:
                self.dropped_saves += len(keys) - first
            return
        # cache tensors are replaced, never written in place, as generation goes on, so the
        # pool's save thread may read these references while the model keeps decoding
        merged = merged_retention(self.retention, retention)
        saving = list(keys[first:])
        try:
            retain_for_save(self.store, self.ns, saving, retention_now(merged))
            ticket = self.store.save(self.ns, saving, self._gather(layers, first),
                                     defer=True)
        except Exception as exc:  # a save never fails inference
            log.warning("kvpool: saving %d chunks failed: %s", len(keys) - first, exc)
            with self._lock:
                self.dropped_saves += len(keys) - first
            return
        with self._lock:
            self._tickets.append(ticket)
        self._count_saves()

    def flush(self) -> None:
        """Wait for background saves (the store's flush: commits and write-behind)."""
        if self.store is not None:
            self.store.flush()
        self._count_saves(wait=True)

    # ------------------------------------------------------------------ prefill / generate
    @torch.inference_mode()
    def prefill(self, input_ids: Sequence[int],
                retention: Mapping[str, Any] | None = None) -> Prefill:
        """Restore what the store has, compute the rest, start saving new chunks (with
        ``retention``, see the class)."""
        pre, keys, restored = self._prefill(input_ids)
        self.save_async(pre.cache, keys, restored, retention)
        return pre

    def _prefill(self, input_ids: Sequence[int]) -> tuple[Prefill, list[bytes], int]:
        """``prefill`` without the save: (result, the prompt's chunk keys, chunks restored);
        the caller starts the save of chunks ``restored..`` (``save_async``)."""
        ids = list(input_ids)
        if not ids:
            raise ValueError("empty prompt")
        t0 = time.perf_counter()
        keys = self.ns.chunk_keys(ids) if self.store is not None else []
        # at least one token must run through the model to produce the next-token logits
        usable = min(len(keys), (len(ids) - 1) // self.ns.chunk_tokens)
        hit = self.store.lookup(self.ns, keys[:usable]) if self.store is not None and usable else 0
        t1 = time.perf_counter()
        cache, restored = self.restore(keys[:hit])
        t2 = time.perf_counter()
        cached = restored * self.ns.chunk_tokens
        if self.store is not None:
            with self._lock:
                self.lookup_chunks += usable
                self.lookup_hit_chunks += hit
                self.restored_tokens += cached
        if cache is None:
            cache = DynamicCache(config=self.model.config)
        suffix = torch.tensor([ids[cached:]], dtype=torch.long)
        out = self.model(input_ids=suffix, cache=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1]
        t3 = time.perf_counter()
        pre = Prefill(logits=logits, cache=out.cache, prompt_tokens=len(ids),
                      cached_tokens=cached,
                      timings={"lookup_s": t1 - t0, "load_s": t2 - t1, "forward_s": t3 - t2})
        return pre, keys, restored

    @torch.inference_mode()
    def generate(self, input_ids: Sequence[int], max_new_tokens: int,
                 eos_token_id: int | None = None,
                 retention: Mapping[str, Any] | None = None) -> Generation:
        """Greedy decoding; ``ttft_s`` is the time to the first generated token. The new
        chunks' save starts right after that token, before the first decode step."""
        start = time.perf_counter()
        pre, keys, restored = self._prefill(input_ids)
        token = int(torch.argmax(pre.logits))
        ttft = time.perf_counter() - start
        self.ttft.record("hf", ttft)
        self.save_async(pre.cache, keys, restored, retention)
        tokens = [token]
        cache = pre.cache
        while len(tokens) < max_new_tokens and token != eos_token_id:
            out = self.model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True,
                             logits_to_keep=1)
            cache = out.cache
            token = int(torch.argmax(out.logits[0, -1]))
            tokens.append(token)
        return Generation(tokens=tokens, ttft_s=ttft, total_s=time.perf_counter() - start,
                          prefill=pre)

    def close(self) -> None:
        """Wait for the saves, then close the pool if ``open`` opened it."""
        self.flush()
        if self._registry is not None:
            self._registry.unregister(self.metrics)
            self._registry = None
        owned, self._owned = self._owned, None
        if owned is not None:
            owned.close()

