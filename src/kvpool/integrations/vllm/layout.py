"""Namespace and chunk payload layout for vLLM's paged KV memory.

A vLLM KV block (``kv[layer][block_id]``) is an opaque page: its inner layout belongs to the
attention kernel (on CPU ``[kv_heads, block_size, 2 * head_dim]`` with K transposed per head).
kvpool never interprets tokens inside a page; it copies whole pages. A chunk of
``chunk_tokens`` = ``blocks_per_chunk * block_size`` tokens is stored **layer-major**::

    payload = layer 0: page(block 0) page(block 1) ... page(block B-1)
              layer 1: page(block 0) ...
              ...

so one layer of a chunk is one contiguous slice (``layer_bytes`` = B * page bytes), which is
what a layer-by-layer loader copies while earlier layers compute.

The namespace holds everything that makes two pages incompatible: model id and revision, KV
dtype, number of layers, KV heads and head size of this rank, chunk size, tensor-parallel rank
and size, and ``engine_layout`` = vLLM version, attention backend, block size and page shape.
A different value of any of them never hits.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvpool.integrations.torch_dtypes import kv_dtype_name
from kvpool.keys import KVLayout, Namespace

_LAYER_RE = re.compile(r"\.(\d+)\.")


def layer_index(name: str) -> int:
    """Layer number in a vLLM attention layer name (``model.layers.7.self_attn.attn`` -> 7).
    Raises ValueError for a name without exactly one number (what vLLM does too)."""
    found = _LAYER_RE.findall(f".{name}.")
    if len(found) != 1:
        raise ValueError(f"cannot tell the layer index of KV cache {name!r}")
    return int(found[0])


def block_first(kv: torch.Tensor, num_blocks: int | None) -> tuple[torch.Tensor, int]:
    """A view of one layer's KV cache with the block index first, and the dim it was in.

    CPU backends register ``[num_blocks, ...]``; FlashAttention-style backends register
    ``[2, num_blocks, ...]`` (K and V apart), whose page is then ``kv[:, block]`` - a strided
    view that index_select/index_copy_ handle without a copy. Raises ValueError for other
    layouts."""
    if num_blocks is None or kv.shape[0] == num_blocks:
        return kv, 0
    if kv.dim() > 1 and kv.shape[1] == num_blocks:
        return kv.transpose(0, 1), 1
    raise ValueError(f"KV cache of shape {tuple(kv.shape)} has no block dimension of size "
                     f"{num_blocks} first or second; kvpool cannot copy its pages")


@dataclass(frozen=True)
class PageGeometry:
    """The engine's KV pages as registered: layer order, page shape, dtype, block dim."""

    layer_names: tuple[str, ...]
    page_shape: tuple[int, ...]
    dtype: torch.dtype
    block_dim: int = 0

    @property
    def page_bytes(self) -> int:
        n = 1
        for d in self.page_shape:
            n *= d
        return n * self.dtype.itemsize

    @classmethod
    def from_kv_caches(cls, kv_caches: Mapping[str, torch.Tensor],
                       num_blocks: int | None = None
                       ) -> tuple[PageGeometry, dict[str, torch.Tensor]]:
        """Geometry plus block-first views by layer name. Raises ValueError when the layers
        differ in page shape or dtype or have no block dimension (see :func:`block_first`)."""
        if not kv_caches:
            raise ValueError("no KV caches registered")
        names = tuple(sorted(kv_caches, key=layer_index))
        views: dict[str, torch.Tensor] = {}
        dims = set()
        for name in names:
            views[name], dim = block_first(kv_caches[name], num_blocks)
            dims.add(dim)
        first = views[names[0]]
        for name in names:
            t = views[name]
            if t.shape[1:] != first.shape[1:] or t.dtype != first.dtype or len(dims) > 1:
                raise ValueError(f"KV cache {name} has shape {tuple(t.shape)} {t.dtype}, unlike "
                                 f"{names[0]} {tuple(first.shape)} {first.dtype}")
        kv_dtype_name(first.dtype)  # raises ValueError for a dtype kvpool does not store
        geom = cls(names, tuple(int(d) for d in first.shape[1:]), first.dtype, dims.pop())
        return geom, views


@dataclass(frozen=True)
class EngineIdentity:
    """What the namespace needs from the engine config (plain values, picklable)."""

    model: str
    revision: str
    num_kv_heads: int
    head_size: int
    block_size: int
    backend: str
    vllm_version: str


def make_namespace(ident: EngineIdentity, geom: PageGeometry, chunk_tokens: int,
                   tp_rank: int, tp_size: int, tenant_salt: str = "") -> Namespace:
    """The namespace of one tensor-parallel rank's KV. Raises ValueError if the pages do not
    hold exactly ``block_size`` tokens of K and V for this rank's heads (another layout, such
    as MLA, would need its own byte accounting)."""
    dtype = kv_dtype_name(geom.dtype)
    layout = KVLayout(
        dtype=dtype, num_layers=len(geom.layer_names), num_kv_heads=ident.num_kv_heads,
        head_dim=ident.head_size, chunk_tokens=chunk_tokens, kv_factor=2, tp_rank=tp_rank,
        tp_size=tp_size,
        engine_layout=(f"vllm-{ident.vllm_version}:{ident.backend}:block{ident.block_size}:"
                       f"page{list(geom.page_shape)}:blockdim{geom.block_dim}:layer-major-pages"))
    expected = layout.layer_bytes // (chunk_tokens // ident.block_size)
    if expected != geom.page_bytes:
        raise ValueError(f"a KV page has {geom.page_bytes} bytes, expected {expected} for "
                         f"{ident.block_size} tokens x {ident.num_kv_heads} heads x "
                         f"{ident.head_size} x K,V in {dtype}")
    return Namespace(model=ident.model, layout=layout, revision=ident.revision,
                     tenant_salt=tenant_salt)


def namespace_from_canonical(data: Mapping[str, Any]) -> Namespace:
    """Rebuild a Namespace from ``Namespace.canonical()`` (the handshake carries it)."""
    return Namespace(model=data["model"], layout=KVLayout(**data["layout"]),
                     revision=data["revision"], tenant_salt=data["tenant_salt"])
