"""Loading a chunk's layer into vLLM's KV blocks (no vLLM imports).

A chunk's layer holds ``blocks_per_chunk`` pages; the engine keeps them in blocks of its own,
named by a block table. Where the table runs through consecutive blocks (a fresh engine
hands a request's blocks out in ascending order), each run is one slice ``copy_``; otherwise
the pages go by index (``index_copy_``). Measured on the 2-core VM with torch on 2 threads,
12 chunks x 30 layers of 32 pages of 12 KiB (SmolLM2-135M at 6K tokens: what one hit of
``kvpool bench vllm`` loads), three rounds: slice copies 16.0-18.0 ms, ``index_copy_`` of
the same pages 30.3-33.2 ms. Blocks vLLM recycles come back in descending order (it frees a
request's blocks last first), which stays an index copy. (Saves keep ``index_select``: the
other direction measured the other way, 13.5-16.6 ms by index against 23-26 ms in slices.)

Failure contract: none of its own; torch raises for shapes that do not match (a caller's
bug: the namespace pins the page geometry).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: Past this many runs a chunk's pages go by index: each slice copy costs a call (~4 us),
#: and an index copy of a chunk's layer about twice the bytes' slice copy.
MAX_RUNS = 4


@dataclass(frozen=True, slots=True)
class PageMap:
    """Where one chunk's pages live among the engine's blocks: ``runs`` of (first chunk page,
    first block, pages) when there are at most MAX_RUNS of them; else the chunk pages to
    copy (``pages``: None for all, in order) and their ``blocks``, as index tensors."""

    runs: tuple[tuple[int, int, int], ...] | None
    pages: torch.Tensor | None = None
    blocks: torch.Tensor | None = None


def page_map(block_ids: Sequence[int]) -> PageMap:
    """The map of a chunk whose page ``j`` lives in block ``block_ids[j]`` (-1: that page is
    left alone)."""
    runs: list[tuple[int, int, int]] = []
    for j, block in enumerate(block_ids):
        if block < 0:
            continue
        if runs:
            first, start, n = runs[-1]
            if first + n == j and start + n == block:
                runs[-1] = (first, start, n + 1)
                continue
        runs.append((j, block, 1))
    if len(runs) <= MAX_RUNS:
        return PageMap(tuple(runs))
    pos = [j for j, block in enumerate(block_ids) if block >= 0]
    return PageMap(None, None if len(pos) == len(block_ids) else torch.tensor(pos),
                   torch.tensor([block_ids[j] for j in pos], dtype=torch.long))


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
