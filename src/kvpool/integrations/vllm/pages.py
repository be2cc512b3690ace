"""Loading a chunk's layer into vLLM's KV blocks (no vLLM imports).

A chunk's layer holds ``blocks_per_chunk`` pages; the engine keeps them in blocks of its own,
named by a block table. Where the table runs through consecutive blocks (a fresh engine
hands a request's blocks out in ascending order), each run is one slice ``copy_``; otherwise
the pages go by index (``index_copy_``). Measured on the 2-core VM with torch on 2 threads,
SmolLM2-135M's 6K-token hit as vLLM's CPU backend holds it (12 chunks of 512 tokens x 30
layers, 4 pages of 96 KiB each: blocks of 128 tokens), three rounds: one slice copy per chunk
13.5-14.8 ms, ``index_copy_`` of the same pages 19.3-20.7 ms. Blocks vLLM recycles come back
in descending order (it frees a request's blocks last first): a chunk is then 4 runs of one
page, 19.6-19.7 ms, no faster than by index. (Saves keep ``index_select``: slices would
save ~10% there, 17.4-18.1 against 18.4-20.7 ms for the same pages.)

Where the engine's KV lies in host memory with contiguous pages (vLLM's CPU backend), loads
take the byte path instead (``host_pages``, ``host_page_map``, ``load_host_pages``): numpy
copies of the pages' bytes, one ``memcpy`` per run, descending runs included (a negative
stride), on the engine's thread with the GIL released. The same 6K hit on the 2-core AMD EPYC
VM of 2026-12-04, inside running engines: 8.4-10.7 ms per hit against 13.7-14.4 for the torch
copies above (a copy of the same bytes at memory speed, one memcpy of 141 MB, 8.1-8.8 ms).
torch's element-wise copy kernel runs on the engine's 2 OpenMP threads and is slower than one
thread's memcpy here; a copy thread running ahead of the layers was measured too and not kept:
its copies took twice as long beside the forward and the forward as much longer (2 cores, both
the engine's).

Failure contract: none of its own; torch (RuntimeError) and numpy (ValueError) raise for
shapes that do not match (a caller's bug: the namespace pins the page geometry).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

#: Past this many runs a chunk's pages go by index: each slice copy costs a call (~4 us), and
#: an index copy of a chunk's layer ~1.4 times one slice copy of its bytes.
MAX_RUNS = 4


@dataclass(frozen=True, slots=True)
class PageMap:
    """Where one chunk's pages live among the engine's blocks: ``runs`` of (first chunk page,
    first block, pages) when there are at most MAX_RUNS of them; else the chunk pages to
    copy (``pages``: None for all, in order) and their ``blocks``, as index tensors."""

    runs: tuple[tuple[int, int, int], ...] | None
    pages: torch.Tensor | None = None
    blocks: torch.Tensor | None = None


def _runs(block_ids: Sequence[int], descending: bool) -> list[tuple[int, int, int, int]]:
    """A chunk's pages (page ``j`` in block ``block_ids[j]``, -1: left alone) as runs of
    (first chunk page, first block, pages, step): consecutive chunk pages in consecutive
    blocks, ascending (step 1) or, with ``descending``, also descending (step -1)."""
    runs: list[tuple[int, int, int, int]] = []
    for j, block in enumerate(block_ids):
        if block < 0:
            continue
        if runs:
            first, start, n, step = runs[-1]
            if first + n == j:
                if descending and n == 1 and block == start - 1:
                    runs[-1] = (first, start, 2, -1)
                    continue
                if block == start + n * step:
                    runs[-1] = (first, start, n + 1, step)
                    continue
        runs.append((j, block, 1, 1))
    return runs


def _by_index(block_ids: Sequence[int]) -> tuple[list[int] | None, list[int]]:
    """The chunk pages to copy (None: all, in order) and their blocks."""
    pos = [j for j, block in enumerate(block_ids) if block >= 0]
    return None if len(pos) == len(block_ids) else pos, [block_ids[j] for j in pos]


def page_map(block_ids: Sequence[int]) -> PageMap:
    """The map of a chunk whose page ``j`` lives in block ``block_ids[j]`` (-1: that page is
    left alone)."""
    runs = _runs(block_ids, descending=False)
    if len(runs) <= MAX_RUNS:
        return PageMap(tuple((first, start, n) for first, start, n, _ in runs))
    pages, blocks = _by_index(block_ids)
    return PageMap(None, None if pages is None else torch.tensor(pages),
                   torch.tensor(blocks, dtype=torch.long))


def load_pages(kv: torch.Tensor, layer: torch.Tensor, where: PageMap) -> None:
    """Copy a chunk's ``layer`` (``[pages, *page_shape]``, host memory) into the engine's
    block-first ``kv`` (host or accelerator)."""
    if where.runs is not None:
        for first, start, n in where.runs:
            kv[start:start + n].copy_(layer[first:first + n])
        return
    assert where.blocks is not None
    src = layer if where.pages is None else layer.index_select(0, where.pages)
    blocks = where.blocks
    if kv.device != src.device:  # accelerator: one host-to-device copy
        src, blocks = src.to(kv.device), blocks.to(kv.device)
    kv.index_copy_(0, blocks, src)


@dataclass(frozen=True, slots=True)
class HostPageMap:
    """Where one chunk's pages live among the engine's blocks, for byte copies: ``runs`` of
    (first chunk page, first block, pages, step), step 1 for ascending blocks and -1 for
    descending ones, when there are at most MAX_RUNS of them; else the chunk pages to copy
    (``pages``: None for all, in order) and their ``blocks``, as index arrays."""

    runs: tuple[tuple[int, int, int, int], ...] | None
    pages: np.ndarray | None = None
    blocks: np.ndarray | None = None


def host_page_map(block_ids: Sequence[int]) -> HostPageMap:
    """The byte-copy map of a chunk whose page ``j`` lives in block ``block_ids[j]`` (-1: that
    page is left alone)."""
    runs = _runs(block_ids, descending=True)
    if len(runs) <= MAX_RUNS:
        return HostPageMap(tuple(runs))
    pages, blocks = _by_index(block_ids)
    return HostPageMap(None, None if pages is None else np.array(pages),
                       np.array(blocks, dtype=np.int64))


def host_pages(kv: torch.Tensor) -> np.ndarray | None:
    """The bytes of a block-first KV tensor as ``[blocks, page_bytes]`` uint8, sharing its
    memory, when it lies in host memory with every page contiguous; else None (the caller
    copies with torch: accelerator memory, or pages strided as in the ``[2, blocks, ...]``
    layouts)."""
    if kv.device.type != "cpu" or kv.dim() < 2 or kv.requires_grad or not kv.is_contiguous():
        return None
    flat = kv.view(kv.shape[0], -1)
    return flat.view(torch.uint8).numpy()


def load_host_pages(kv: np.ndarray, layer: np.ndarray, where: HostPageMap) -> None:
    """Copy a chunk's ``layer`` (``[pages, page_bytes]`` uint8) into the engine's blocks
    ``kv`` (``host_pages``). Raises ValueError for sizes that do not match (a caller's bug)."""
    if where.runs is not None:
        for first, start, n, step in where.runs:
            if step == 1:
                np.copyto(kv[start:start + n], layer[first:first + n])
            else:
                end = start - n
                np.copyto(kv[start:end if end >= 0 else None:-1], layer[first:first + n])
        return
    assert where.blocks is not None
    kv[where.blocks] = layer if where.pages is None else layer[where.pages]
