"""Loading a chunk's layer into engine blocks: runs of consecutive blocks go as slice copies,
other block tables by index, and both put every page exactly where the block table says
(and nothing elsewhere), in both registered KV layouts."""

from __future__ import annotations

import pytest
import torch

from kvpool.integrations.vllm.layout import block_first
from kvpool.integrations.vllm.pages import MAX_RUNS, load_pages, page_map

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
