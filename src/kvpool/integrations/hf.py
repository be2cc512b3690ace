"""Prefix reuse for Hugging Face transformers causal LMs (DESIGN.md section 7).

For a prompt: build the namespace from the model config, ``lookup`` the longest cached
chunk-aligned prefix, restore it into a DynamicCache, run the model over the suffix only, and
save the new full chunks in the background while generation goes on. Chunk payloads are
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
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from prometheus_client.registry import CollectorRegistry
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvpool.integrations.retention import merged_retention, retain_for_save, retention_now
from kvpool.integrations.torch_dtypes import kv_dtype_name
from kvpool.keys import KVLayout, Namespace
from kvpool.metrics.engine import EngineCollector, EngineCounts
from kvpool.metrics.recorder import LabeledLatency
from kvpool.priority import lower_thread_priority
from kvpool.retention import Retention

log = logging.getLogger("kvpool.integrations.hf")


class ChunkStore(Protocol):
    """What the integration needs from a store (KVPool and FilePerChunkPool provide it)."""

    def register_namespace(self, ns: Namespace) -> Namespace: ...

    def lookup(self, ns: Namespace, keys: Sequence[bytes]) -> int: ...

    def get_many_into(self, ns: Namespace, keys: Sequence[bytes],
                      outs: Sequence[Any]) -> list[bool]: ...

    def reserve(self, ns: Namespace, key: bytes, wait: bool = True) -> Any:
        """A reservation (``.view`` to fill, ``commit()``, ``abort()``), or True when the chunk
        is already stored, False/None when there is no room (KVPool.reserve)."""
        ...

    def commit_many(self, reservations: Sequence[Any]) -> int: ...

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
    ``save_wait_s``: how long a prefill waits for a still-running save of chunks it shares
    before it recomputes them instead (read-your-writes). ``retention``: what its saves ask
    to be kept for (docs/retention.md), e.g. ``{"priority": "high", "ttl_s": 3600}``; a
    ``prefill`` / ``generate`` call's own ``retention=`` overrides it key by key (a pin the
    pool refuses is logged and the chunks saved unpinned). ArgumentError for a bad one.

    Saving stays off the request that produced the KV: ``generate`` starts the save only once
    the first token is out, so the copies into the store never share the TTFT window, and the
    saver thread's nice value is the engine thread's plus ``saver_nice`` (Linux; 0: the same
    priority), so while it overlaps decode steps or the next prefill the scheduler gives the
    engine's threads the cores first. It is never starved: a nice thread still gets its share
    of a busy core, and a prefill that waits for it (read-your-writes) leaves it the core.

    ``metrics`` exports the engine metrics (engine="hf": tokens looked up, loaded, saved;
    TTFT of ``generate``); it is added to the store's registry when the store is a KVPool
    (so its ``metrics.port`` serves them) and removed again by ``close``.
    """

    def __init__(self, model: Any, store: ChunkStore | None, chunk_tokens: int = 256,
                 tenant_salt: str = "", model_id: str | None = None,
                 save_wait_s: float = 2.0, saver_nice: int = 10,
                 retention: Mapping[str, Any] | None = None) -> None:
        self.model = model
        Retention.from_mapping(retention)  # a bad one fails now
        self.retention = dict(retention) if retention else None
        self.store = store
        self.save_wait_s = save_wait_s
        self.ns = namespace_for(model, chunk_tokens, tenant_salt, model_id)
        if store is not None:
            store.register_namespace(self.ns)
        self.layers, self.kv_heads, self.head_dim, self.dtype = model_shape(model)
        _attention_layers(DynamicCache(config=model.config))  # fail now, not mid-request
        self._staging: torch.Tensor | None = None
        self._restored: torch.Tensor | None = None
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvpool-hf-save",
                                         initializer=lower_thread_priority, initargs=(saver_nice,))
        self._pending: list[tuple[Future[int], frozenset[bytes]]] = []  # saves and their keys
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

    def engine_counts(self) -> EngineCounts:
        c = self.ns.chunk_tokens
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
        self._chunk_buffer(n).zero_()
        self._restore_target(n).zero_()

    def _chunk_buffer(self, n: int) -> torch.Tensor:
        """Staging for ``n`` chunks as stored: [n, L, 2, H, C, D], reused across requests."""
        if self._staging is None or self._staging.shape[0] < n:
            c = self.ns.chunk_tokens
            self._staging = torch.empty((n, self.layers, 2, self.kv_heads, c, self.head_dim),
                                        dtype=self.dtype)
        return self._staging[:n]

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

        Chunks resident in DRAM are copied straight from pinned slots into the cache tensors
        (one copy); the others go through the staging buffer (get_many_into, then a copy)."""
        if self.store is None or not keys:
            return None, 0
        pin = getattr(self.store, "pin_many", None)
        views: list[Any] = pin(self.ns, keys) if pin is not None else [None] * len(keys)
        try:
            missing = [i for i, v in enumerate(views) if v is None]
            buf = self._chunk_buffer(len(keys))
            fetched = dict(zip(missing, self.store.get_many_into(
                self.ns, [keys[i] for i in missing],
                [buf[i].view(torch.uint8).numpy().reshape(-1) for i in missing]),
                strict=True)) if missing else {}
            n = next((i for i in range(len(keys)) if views[i] is None and not fetched[i]),
                     len(keys))
            if n == 0:
                return None, 0
            c = self.ns.chunk_tokens
            kv = self._restore_target(n)  # [L, 2, 1, H, n*C, D]: per-layer contiguous K/V
            by_chunk = kv.view(self.layers, 2, self.kv_heads, n, c, self.head_dim)
            stored_shape = (self.layers, 2, self.kv_heads, c, self.head_dim)
            with warnings.catch_warnings():  # pinned slots are read-only; we only read them
                warnings.simplefilter("ignore", UserWarning)
                for i in range(n):
                    # a temporary: its export of the slot ends with the statement, before
                    # release() below
                    by_chunk[:, :, :, i].copy_(
                        torch.frombuffer(views[i].data, dtype=self.dtype).view(stored_shape)
                        if views[i] is not None else buf[i])
        finally:
            for view in views:
                if view is not None:
                    view.release()
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
    def _save(self, cache_layers: list[tuple[torch.Tensor, torch.Tensor]],
              keys: list[bytes], first: int, retention: dict[str, Any] | None = None) -> int:
        """Copy chunks ``first..`` of the cache straight into reserved slots of the store (one
        copy per byte), then commit them as one batch."""
        assert self.store is not None
        c = self.ns.chunk_tokens
        shape = (self.layers, 2, self.kv_heads, c, self.head_dim)
        stored = 0
        slots: list[Any] = []
        retain_for_save(self.store, self.ns, keys[first:], retention_now(retention))
        try:
            for j, key in enumerate(keys[first:], start=first):
                slot = self.store.reserve(self.ns, key)
                if slot is None or isinstance(slot, bool):  # already stored / no room
                    stored += bool(slot)
                    continue
                slots.append(slot)
                dst = torch.frombuffer(slot.view, dtype=self.dtype).view(shape)
                for layer, (k, v) in enumerate(cache_layers):
                    dst[layer, 0].copy_(k[0, :, j * c:(j + 1) * c])
                    dst[layer, 1].copy_(v[0, :, j * c:(j + 1) * c])
            stored += self.store.commit_many(slots)
        except Exception as exc:  # a save never fails inference: the rest is dropped, counted
            log.warning("kvpool: saving chunks failed after %d: %s", stored, exc)
        finally:
            for slot in slots:
                slot.abort()  # a no-op once committed
        with self._lock:
            self.saved_chunks += stored
            self.dropped_saves += (len(keys) - first) - stored
        return stored

    def save_async(self, cache: DynamicCache, keys: Sequence[bytes], first: int,
                   retention: Mapping[str, Any] | None = None) -> None:
        """Hand chunks ``first..len(keys)`` of a filled cache to the store in the background,
        with the engine's retention under ``retention``'s keys. Layers whose cache no longer
        holds every token (sliding windows) make the chunks unsavable: they are skipped and
        counted as dropped."""
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
        # saver may read these references while the model keeps decoding
        self._pending = [(f, k) for f, k in self._pending if not f.done()]
        merged = merged_retention(self.retention, retention)
        self._pending.append((self._saver.submit(self._save, layers, list(keys), first, merged),
                              frozenset(keys[first:])))

    def _wait_for_saves_of(self, keys: Sequence[bytes]) -> None:
        """Read-your-writes: a prompt that shares chunks with a save still running waits for
        that save (at most ``save_wait_s``; then those chunks are recomputed), so the request
        right after the one that produced a prefix never misses it."""
        wanted = set(keys)
        running = [f for f, k in self._pending if not f.done() and k & wanted]
        if running:
            futures.wait(running, timeout=self.save_wait_s)

    def flush(self) -> None:
        """Wait for background saves, then for the store's own write-behind."""
        for fut, _ in self._pending:
            fut.result()
        self._pending.clear()
        if self.store is not None:
            self.store.flush()

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
        if usable:
            self._wait_for_saves_of(keys[:usable])
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
        self.flush()
        self._saver.shutdown(wait=True)
        if self._registry is not None:
            self._registry.unregister(self.metrics)
            self._registry = None

