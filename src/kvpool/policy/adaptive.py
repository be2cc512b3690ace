"""Adaptive prefix S3-FIFO: ``prefix`` whose small-queue share is tuned online, ARC-style.

S3-FIFO keeps new chunks in a small FIFO S (a fixed 10% of the cache) and promotes to the main
queue M only those used again while in S. On real multi-turn traffic most reuses come after
more new chunks than 10% of the cache (the conversation trace: first-reuse distance median
about 10,500 references), so S evicts them before their first reuse; a larger S, in turn,
lets one-time chunks crowd out M's reused ones when the cache is small. This policy moves the
share as ARC moves its target (Megiddo and Modha, FAST 2003): a key inserted again while
remembered as evicted from S (ghost G_S) says S was too small, so S grows; one evicted from M
(ghost G_M, keys only, as long as the cache) says M was too small, so S shrinks; each step is
``1 / residents`` scaled by the other ghost's relative size, the share kept within
[``min_fraction``, ``max_fraction``]. Everything else is ``PrefixS3FIFOPolicy`` (prefix.py).

Memory: residents plus two ghost lists of keys, each at most the resident count (at least
``ghost_min``). Every operation O(1) amortised, like S3-FIFO's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvpool.policy.base import Key
from kvpool.policy.prefix import PrefixS3FIFOPolicy


class AdaptivePrefixS3FIFOPolicy(PrefixS3FIFOPolicy):
    """Raises ValueError for bounds outside (0, 1) or min above max."""

    def __init__(self, small_fraction: float = 0.1, min_fraction: float = 0.1,
                 max_fraction: float = 0.4, ghost_min: int = 64, gain: float = 8.0) -> None:
        if not 0 < min_fraction <= small_fraction <= max_fraction < 1:
            raise ValueError("need 0 < min_fraction <= small_fraction <= max_fraction < 1")
        super().__init__(small_fraction, ghost_min)
        self._min_fraction, self._max_fraction = min_fraction, max_fraction
        self._main_ghost: OrderedDict[Key, None] = OrderedDict()
        self._gain = gain

    @property
    def small_fraction(self) -> float:
        return self._small_fraction

    def _adapt(self, grow_small: bool) -> None:
        n = max(1, len(self._freq)) / self._gain
        if grow_small:
            step = max(1.0, len(self._main_ghost) / max(1, len(self._ghost))) / n
            self._small_fraction = min(self._max_fraction, self._small_fraction + step)
        else:
            step = max(1.0, len(self._ghost) / max(1, len(self._main_ghost))) / n
            self._small_fraction = max(self._min_fraction, self._small_fraction - step)

    def insert(self, key: Key) -> None:
        if key not in self._freq:
            if key in self._ghost:
                self._adapt(grow_small=True)
            elif key in self._main_ghost:
                del self._main_ghost[key]
                self._adapt(grow_small=False)
        super().insert(key)

    def remove(self, key: Key) -> None:
        super().remove(key)
        self._main_ghost.pop(key, None)

    def evict(self, evictable: Callable[[Key], bool]) -> Key | None:
        from_main = None
        key = super().evict(evictable)
        if key is not None and key not in self._ghost:  # S3-FIFO remembers only S's victims
            from_main = key
        if from_main is not None:
            self._main_ghost[from_main] = None
            limit = max(self._ghost_min, len(self._freq))
            while len(self._main_ghost) > limit:
                self._main_ghost.popitem(last=False)
        return key
