"""Scheduler-side bookkeeping: which chunks each step loads and stores (no vLLM imports).

Per request the scheduler keeps a :class:`RequestPlan`. Each step vLLM tells it how many
tokens were already computed (``computed_before``), how many it schedules now, and the
request's current block table; the plan answers with

* loads: the chunks the connector promised in ``get_num_new_matched_tokens`` (once, in the
  step after ``update_state_after_alloc``), as pool keys and destination blocks; blocks vLLM
  already holds from its own prefix cache are skipped (``-1``);
* stores: the prompt chunks that become fully computed by the end of this step and are not yet
  in the pool. They are saved in the same forward, right after each layer's attention wrote
  them, so chunked prefill stores each chunk exactly once, in the step that completes it.

Preemption frees the blocks and resets ``computed_before`` to 0; the resumed request is looked
up and allocated again, so the next step plans a fresh load into the new blocks. A load that
fails (miss, checksum) lowers ``stored`` so the recomputed chunks are saved again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ChunkCopy:
    """One chunk: its key on every tensor-parallel rank and one engine block per page
    (``-1``: leave that page alone)."""

    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ReqTransfer:
    req_id: str
    chunks: tuple[ChunkCopy, ...]
    #: Stores: the retention parameters of the request's saves (docs/retention.md).
    retention: dict[str, Any] | None = None


@dataclass(slots=True)
class RequestPlan:
    """``keys[c]`` holds chunk c's key per rank; ``prompt_len`` counts prompt tokens."""

    req_id: str
    keys: list[tuple[bytes, ...]]
    prompt_len: int
    chunk_tokens: int
    block_size: int
    stored: int = 0  # leading chunks known to be in the pool (or on their way)
    pending_load_tokens: int = 0  # set by update_state_after_alloc, used by the next step
    last_load_blocks: dict[int, int] = field(default_factory=dict)  # block id -> chunk

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_size

    def _copy(self, chunk: int, block_table: Sequence[int], first_block: int) -> ChunkCopy | None:
        bpc = self.blocks_per_chunk
        ids = []
        for j in range(bpc):
            idx = chunk * bpc + j
            if idx >= len(block_table):
                return None  # not allocated: vLLM never schedules past its blocks
            ids.append(block_table[idx] if idx >= first_block else -1)
        return ChunkCopy(self.keys[chunk], tuple(ids))

    def step(self, computed_before: int, num_scheduled: int,
             block_table: Sequence[int]) -> tuple[ReqTransfer | None, ReqTransfer | None]:
        """(load, store) for this step; either may be None."""
        load = None
        if self.pending_load_tokens > 0:
            end = computed_before
            start = end - self.pending_load_tokens
            self.pending_load_tokens = 0
            copies = []
            self.last_load_blocks = {}
            first_block = start // self.block_size
            for c in range(start // self.chunk_tokens, end // self.chunk_tokens):
                copy = self._copy(c, block_table, first_block)
                if copy is None:
                    break
                copies.append(copy)
                self.last_load_blocks.update((b, c) for b in copy.block_ids if b >= 0)
            if copies:
                load = ReqTransfer(self.req_id, tuple(copies))
                self.stored = max(self.stored, end // self.chunk_tokens)
        done = min(computed_before + num_scheduled, self.prompt_len) // self.chunk_tokens
        done = min(done, len(self.keys))
        stores = []
        for c in range(self.stored, done):
            copy = self._copy(c, block_table, 0)
            if copy is None:
                break
            stores.append(copy)
        self.stored += len(stores)
        return load, (ReqTransfer(self.req_id, tuple(stores)) if stores else None)

    def load_failed(self, invalid_blocks: set[int]) -> bool:
        """Forget chunks whose load failed, so their recomputed KV is stored again. True if
        this request was affected."""
        bad = [c for b, c in self.last_load_blocks.items() if b in invalid_blocks]
        if not bad:
            return False
        self.stored = min(self.stored, min(bad))
        self.last_load_blocks = {}
        return True
