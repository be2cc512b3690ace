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

Failure contract: none of its own; torch raises for shapes that do not match (a caller's
bug: the namespace pins the page geometry).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
