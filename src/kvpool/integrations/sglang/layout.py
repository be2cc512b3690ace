"""Namespace, keys and page payload layout for SGLang's HiCache host pool (no SGLang import).

One SGLang page (``page_size`` tokens, every layer, K and V) is one kvpool chunk. Its payload
is exactly what SGLang's legacy ``get_data_page(flat=True)`` returns for the host layout, so
pages written through the v1 path (raw addresses) and the legacy path (flat tensors) are the
same bytes:

* ``layer_first``: ``[2, layers, page_size, heads, head_dim]`` (every layer's K, then every
  layer's V); SGLang's ``get_page_buffer_meta`` gives ``2 * layers`` pieces per page, in the
  order K0 V0 K1 V1 ..., which ``piece_offsets`` places at their flat-page offsets;
* ``page_first`` / ``page_first_direct``: two pieces per page, K then V, each
  ``[page_size, layers, heads, head_dim]`` resp. ``[layers, page_size, heads, head_dim]``.

The namespace holds everything that makes two pages incompatible: model, dtype, layers, KV
heads and head size, page size (the chunk size), host layout, tensor-parallel rank and size
(for MLA none: every rank holds the same latent KV and only one writes), pipeline rank and
size and attention context-parallel rank and size. SGLang's page keys (64-hex SHA-256 chained
page hashes) become 16-byte kvpool keys by xxh3-128 over the namespace id and the hash bytes:
deterministic across processes and machines.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from kvpool.keys import DTYPE_BYTES, KVLayout, Namespace

#: Host layouts whose pages kvpool copies (SGLang's other layouts are refused at registration).
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
_KEY_DOMAIN = b"kvpool-sglang-page\0"


@dataclass(frozen=True)
class RankIdentity:
    """What the namespace needs from SGLang's ``HiCacheStorageConfig`` (plain values)."""

    model: str
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    is_mla: bool = False


@dataclass(frozen=True)
class PageGeometry:
    """The host pool's pages: layout, dtype name (a key of ``kvpool.keys.DTYPE_BYTES``) and
    shape. Raises ValueError on construction for a layout kvpool does not copy."""

    layout: str
    dtype: str
    layers: int
    heads: int
    head_dim: int
    page_size: int

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"SGLang host layout {self.layout!r} is not supported by kvpool; "
                             f"use one of {', '.join(LAYOUTS)} (--hicache-mem-layout)")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}")

    @property
    def piece_bytes(self) -> int:
        """Bytes of one piece of ``get_page_buffer_meta`` (one layer's K or V for
        ``layer_first``, all layers' K or V otherwise)."""
        n = self.page_size * self.heads * self.head_dim * DTYPE_BYTES[self.dtype]
        return n if self.layout == "layer_first" else n * self.layers

    @property
    def pieces_per_page(self) -> int:
        return 2 * self.layers if self.layout == "layer_first" else 2

    @property
    def page_bytes(self) -> int:
        return self.piece_bytes * self.pieces_per_page

    def piece_offsets(self) -> list[int]:
        """Payload offset of each piece of a page, in ``get_page_buffer_meta`` order."""
        s = self.piece_bytes
        if self.layout == "layer_first":  # K0 V0 K1 V1 ... -> K0 K1 ... V0 V1 ...
            return [(j % 2) * self.layers * s + (j // 2) * s
                    for j in range(self.pieces_per_page)]
        return [j * s for j in range(self.pieces_per_page)]


def make_namespace(rank: RankIdentity, geom: PageGeometry, tenant_salt: str = "") -> Namespace:
    """The namespace of one SGLang rank's pages. MLA: tensor-parallel rank and size are left
    out (all ranks share one copy, written by one rank). Raises ArgumentError for bad values."""
    tp_rank, tp_size = (0, 1) if rank.is_mla else (rank.tp_rank, rank.tp_size)
    layout = KVLayout(
        dtype=geom.dtype, num_layers=geom.layers, num_kv_heads=geom.heads,
        head_dim=geom.head_dim, chunk_tokens=geom.page_size, kv_factor=2,
        tp_rank=tp_rank, tp_size=tp_size,
        engine_layout=(f"sglang-hicache {geom.layout} pp{rank.pp_rank}/{rank.pp_size} "
                       f"cp{rank.cp_rank}/{rank.cp_size}"))
    return Namespace(model=rank.model, layout=layout, tenant_salt=tenant_salt)


def page_key(ns: Namespace, page_hash: str) -> bytes:
    """The 16-byte kvpool key of one SGLang page key in ``ns``: a 64-hex page hash counts as
    its 32 bytes, any other string (legacy callers' own keys) as its UTF-8 bytes."""
    try:
        raw = bytes.fromhex(page_hash) if len(page_hash) == 64 else page_hash.encode()
    except ValueError:
        raw = page_hash.encode()
    return bytes(xxhash.xxh3_128_digest(_KEY_DOMAIN + ns.id + raw))
