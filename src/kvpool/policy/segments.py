"""SSD segment-eviction policies: the oldest segment is always the one freed (so tombstones
outlive what they delete); the policy only chooses which of its records are copied forward."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class SegmentPolicy(Protocol):
    def copy_forward(self, hot: np.ndarray, blocks: np.ndarray, budget_blocks: int) -> np.ndarray:
        """Indices (into the victim's live records) to rewrite at the log head, given which
        were read since written (``hot``) and each record's size in 4 KiB blocks."""
        ...


class FifoSegments:
    def copy_forward(self, hot: np.ndarray, blocks: np.ndarray, budget_blocks: int) -> np.ndarray:
        return np.zeros(0, dtype=np.int64)


class SecondChanceSegments:
    """Records read since they were written get a second life, up to the budget."""

    def copy_forward(self, hot: np.ndarray, blocks: np.ndarray, budget_blocks: int) -> np.ndarray:
        idx = np.flatnonzero(hot)
        if idx.size == 0 or budget_blocks <= 0:
            return idx[:0]
        within = np.cumsum(blocks[idx]) <= budget_blocks
        return idx[within]
