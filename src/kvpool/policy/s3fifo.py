"""S3-FIFO (Yang et al., SOSP 2023): a scan-resistant policy built from three FIFO queues.

New keys enter a small queue S (about 10% of residents). A key leaving S that was accessed
while there moves to the main queue M; otherwise it is evicted and remembered in a ghost queue
G. A key inserted while in G goes straight to M. Keys leaving M are reinserted while their
access counter (capped at 3) is positive, decrementing it. One-hit wonders (a long scan) thus
pass through S without displacing the reused working set in M.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvpool.policy.base import EvictionPolicy, Key

SMALL_FRACTION = 0.1
MAX_FREQ = 3


class S3FIFOPolicy(EvictionPolicy):
    def __init__(self, small_fraction: float = SMALL_FRACTION, ghost_min: int = 64) -> None:
        self._small: OrderedDict[Key, None] = OrderedDict()  # oldest first
        self._main: OrderedDict[Key, None] = OrderedDict()
        self._ghost: OrderedDict[Key, None] = OrderedDict()
        self._freq: dict[Key, int] = {}
        self._small_fraction = small_fraction
        self._ghost_min = ghost_min

    def insert(self, key: Key) -> None:
        if key in self._freq:
            self.touch(key)
            return
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None

    def touch(self, key: Key) -> None:
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, MAX_FREQ)

    def remove(self, key: Key) -> None:
        if self._freq.pop(key, None) is not None:
            self._small.pop(key, None)
            self._main.pop(key, None)

    def _remember_ghost(self, key: Key) -> None:
        self._ghost[key] = None
        limit = max(self._ghost_min, len(self._freq))
        while len(self._ghost) > limit:
            self._ghost.popitem(last=False)

    def evict(self, evictable: Callable[[Key], bool]) -> Key | None:
        # Each resident can be moved at most a few times (freq <= 3) before it is a victim,
        # so this bound only trips when every resident is pinned.
        for _ in range((MAX_FREQ + 2) * max(1, len(self._freq))):
            total = len(self._small) + len(self._main)
            if total == 0:
                return None
            use_small = self._small and (len(self._small) > self._small_fraction * total
                                         or not self._main)
            if use_small:
                key, _ = self._small.popitem(last=False)
                if self._freq[key] >= 1 or not evictable(key):
                    self._freq[key] = 0  # a promoted key must earn its next reinsertion
                    self._main[key] = None
                    continue
                del self._freq[key]
                self._remember_ghost(key)
                return key
            key, _ = self._main.popitem(last=False)
            if not evictable(key) or self._freq[key] > 0:
                self._freq[key] = max(0, self._freq[key] - 1)
                self._main[key] = None
                continue
            del self._freq[key]
            return key
        return None

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq
