"""ARC (Megiddo and Modha, FAST 2003).

Two LRU lists: T1 holds keys seen once recently, T2 keys seen at least twice (a touch moves a
key from T1 to T2). Two ghost lists of evicted keys (keys only): B1 for T1's victims, B2 for
T2's. A key inserted while in B1 says T1 was too small: the target size ``p`` of T1 grows (by
``max(1, |B2| / |B1|)``); one in B2 says T2 was too small: ``p`` shrinks likewise; either way
the key goes to T2. The victim is T1's least recent key while T1 holds more than ``p`` keys,
else T2's. So the share between recency and frequency follows the workload: on the
conversation trace most reuses are single and come after many new chunks (T1 should be large),
on the synthetic one chunks come back several times (T2 should be).

The capacity is the resident count when ``evict`` is called (the tier calls it only when
full). Each ghost list keeps at most ``ghost_factor`` times the resident count (at least
``ghost_min``) keys: with 3 (the best of 1, 2 and 3 on the Mooncake traces, docs/plan.md)
the memory is the residents' keys seven times over. Every operation O(1) amortised; a pinned key
is skipped in place, as by LRU.

No put-batch hint: until issue 25 a batch's deepest key went to T1's evict end, because a
request's last block is partial and almost never reused; but engines never store a partial
block (nor does ``kvpool plan`` any more), and the deepest *full* block of a put is reused
as often as the others (30% of first puts on the conversation head, 17% on the synthetic
trace), so the hint evicted each conversation's newest full block before the follow-up turn
that needs it: at DRAM 5/10/25/50% of the conversation head 0.127/0.190/0.281/0.326 with it,
0.127/0.188/0.282/0.329 without (docs/plan.md).

Known weakness (the conversation head at DRAM 50%, where LRU hits 0.335): T1 is never shorter
than ``p`` there, so nothing is ever evicted from T2 and a chunk reused once stays for good,
though on conversation traffic it is often done; ARC then evicts exactly what S3-FIFO does
(the oldest chunk not reused since its put) and both hit 0.329.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvpool.policy.base import EvictionPolicy, Key


class ARCPolicy(EvictionPolicy):
    """Raises ValueError for a ghost factor below 0."""

    def __init__(self, ghost_factor: float = 3.0, ghost_min: int = 64) -> None:
        if ghost_factor < 0:
            raise ValueError(f"ghost_factor must be >= 0, got {ghost_factor}")
        self._t1: OrderedDict[Key, None] = OrderedDict()  # least recent first
        self._t2: OrderedDict[Key, None] = OrderedDict()
        self._b1: OrderedDict[Key, None] = OrderedDict()
        self._b2: OrderedDict[Key, None] = OrderedDict()
        self._ghost_factor = ghost_factor
        self._ghost_min = ghost_min
        self.p = 0.0  # target size of T1, in keys

    def insert(self, key: Key) -> None:
        if key in self:
            self.touch(key)
            return
        c = max(1, len(self) + 1)
        if key in self._b1:
            self.p = min(c, self.p + max(1.0, len(self._b2) / len(self._b1)))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self.p = max(0.0, self.p - max(1.0, len(self._b1) / len(self._b2)))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None

    def touch(self, key: Key) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._t1.pop(key, None)
        self._t2.pop(key, None)

    def _remember(self, ghost: OrderedDict[Key, None], key: Key) -> None:
        ghost[key] = None
        limit = max(self._ghost_min, int(self._ghost_factor * len(self)))
        while len(ghost) > limit:
            ghost.popitem(last=False)

    def evict(self, evictable: Callable[[Key], bool]) -> Key | None:
        if self._t1 and (len(self._t1) > self.p or not self._t2):
            lists = ((self._t1, self._b1), (self._t2, self._b2))
        else:
            lists = ((self._t2, self._b2), (self._t1, self._b1))
        for order, ghost in lists:
            for key in order:
                if evictable(key):
                    del order[key]
                    self._remember(ghost, key)
                    return key
        return None

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2
