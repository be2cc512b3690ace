"""Loading a chunk's layer into engine blocks: runs of consecutive blocks go as slice copies,
other block tables by index, and both put every page exactly where the block table says
(and nothing elsewhere), in both registered KV layouts; the byte path for blocks in host
memory (runs ascending or descending) does the same."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpool.integrations.vllm.layout import block_first
from kvpool.integrations.vllm.pages import (
    MAX_RUNS,
    host_page_map,
    host_pages,
    load_host_pages,
    load_pages,
    page_map,
)

NBLOCKS, PAGES = 40, 8


def test_a_block_table_is_cut_into_runs_of_consecutive_blocks() -> None:
    assert page_map([4, 5, 6, 7]).runs == ((0, 4, 4),)
    assert page_map([-1, -1, 9, 10]).runs == ((2, 9, 2),)
    assert page_map([4, 5, 20, 21]).runs == ((0, 4, 2), (2, 20, 2))
    assert page_map([4, -1, 6, 7]).runs == ((0, 4, 1), (2, 6, 2))  # a gap ends a run


def test_a_table_of_many_runs_goes_by_index() -> None:
    descending = list(range(30, 30 - PAGES, -1))  # what recycled blocks look like
    where = page_map(descending)
    assert where.runs is None and where.pages is None
    assert where.blocks is not None and where.blocks.tolist() == descending
    skipping = [-1, 3, 1, 8, 6, 12, 10, 15]
    where = page_map(skipping)
    assert where.runs is None
    assert where.pages is not None and where.pages.tolist() == list(range(1, PAGES))
    assert where.blocks is not None and where.blocks.tolist() == skipping[1:]
    assert len(page_map([0, 2, 4, 6][:MAX_RUNS]).runs or ()) == MAX_RUNS


def engine_blocks(block_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(registered tensor, its block-first view) of random bf16 pages."""
    g = torch.Generator().manual_seed(block_dim)
    shape = (NBLOCKS, 2, 4, 16) if block_dim == 0 else (2, NBLOCKS, 4, 2, 8)
    kv = torch.randn(shape, generator=g, dtype=torch.bfloat16)
    return kv, block_first(kv, NBLOCKS)[0]


TABLES = {
    "ascending": list(range(5, 5 + PAGES)),
    "two runs": [5, 6, 7, 8, 20, 21, 22, 23],
    "descending": list(range(30, 30 - PAGES, -1)),
    "skips and scatter": [-1, -1, 33, 2, 17, 18, 9, 0],
    "descending to block 0": [7, 6, 5, 4, 3, 2, 1, 0],
    "runs both ways": [10, 11, 12, 13, 3, 2, 1, 0],
}


@pytest.mark.parametrize("block_dim", [0, 1])
@pytest.mark.parametrize("table", sorted(TABLES))
def test_a_load_puts_each_page_in_its_block_and_nothing_elsewhere(block_dim: int,
                                                                 table: str) -> None:
    blocks = TABLES[table]
    kv, view = engine_blocks(block_dim)
    before = view.clone()
    g = torch.Generator().manual_seed(7)
    layer = torch.randn((PAGES, *view.shape[1:]), generator=g).to(view.dtype)
    load_pages(view, layer, page_map(blocks))
    for b in range(NBLOCKS):
        if b in blocks:
            assert torch.equal(view[b], layer[blocks.index(b)]), (table, b)
        else:
            assert torch.equal(view[b], before[b]), (table, b)  # untouched
    assert view.data_ptr() == block_first(kv, NBLOCKS)[0].data_ptr()  # in place


def test_the_byte_path_cuts_a_table_into_runs_either_way() -> None:
    assert host_page_map([4, 5, 6, 7]).runs == ((0, 4, 4, 1),)
    assert host_page_map([30, 29, 28, 27]).runs == ((0, 30, 4, -1),)  # recycled blocks
    assert host_page_map([-1, 9, 8, 20]).runs == ((1, 9, 2, -1), (3, 20, 1, 1))
    assert host_page_map([4, 5, 4, 3]).runs == ((0, 4, 2, 1), (2, 4, 2, -1))
    assert host_page_map([4, -1, 3, 2]).runs == ((0, 4, 1, 1), (2, 3, 2, -1))  # a gap ends a run
    scatter = host_page_map([-1, -1, 33, 2, 17, 18, 9, 0])  # 5 runs: by index
    assert scatter.runs is None and scatter.pages is not None and scatter.blocks is not None
    assert scatter.pages.tolist() == list(range(2, PAGES))
    assert scatter.blocks.tolist() == [33, 2, 17, 18, 9, 0]


def test_only_host_blocks_with_contiguous_pages_take_the_byte_path() -> None:
    kv, view = engine_blocks(0)
    blocks = host_pages(view)
    assert blocks is not None and blocks.shape == (NBLOCKS, view[0].numel() * 2)
    assert np.shares_memory(blocks, kv.view(torch.uint8).numpy())
    assert host_pages(engine_blocks(1)[1]) is None  # [2, blocks, ...]: pages are strided


@pytest.mark.parametrize("table", sorted(TABLES))
def test_a_byte_load_puts_each_page_in_its_block_and_nothing_elsewhere(table: str) -> None:
    blocks = TABLES[table]
    _, view = engine_blocks(0)
    before = view.clone()
    g = torch.Generator().manual_seed(7)
    layer = torch.randn((PAGES, *view.shape[1:]), generator=g).to(view.dtype)
    dst = host_pages(view)
    assert dst is not None
    load_host_pages(dst, layer.view(PAGES, -1).view(torch.uint8).numpy(), host_page_map(blocks))
    for b in range(NBLOCKS):
        if b in blocks:
            assert torch.equal(view[b], layer[blocks.index(b)]), (table, b)
        else:
            assert torch.equal(view[b], before[b]), (table, b)  # untouched
