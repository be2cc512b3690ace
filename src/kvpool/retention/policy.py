"""Retention around any eviction policy: the policy orders victims, this wrapper says which
it may not take and which go first (DESIGN: policy objects apart from the byte movers).

Victims are sought in passes: a chunk whose TTL passed, then an ephemeral chunk (oldest
first), then what the inner policy picks, and only when it has none, the oldest HIGH chunk. A
pinned chunk (PIN until its deadline or its session's release) is never a victim; a tier full
of pins drops the save, as it does for chunks pinned by readers.

Cost: protected (PIN and HIGH) keys are held here, out of the inner policy, so its victim
search never walks over them (a DRAM full of HIGH chunks would otherwise cost a scan of all of
them per eviction). A key protected after it was inserted moves here the first time the inner
policy offers it; a protection that lapsed moves the key back, found by a few keys of
round-robin checks per eviction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvpool.policy.base import EvictionPolicy, Key
from kvpool.retention.book import RetentionBook
from kvpool.retention.spec import Priority

#: Protected keys checked per eviction for a lapsed protection.
_LAPSE_CHECKS = 4


class RetainingPolicy(EvictionPolicy):
    """Wraps ``inner`` (one per DRAM size class) with ``book``'s retention."""

    def __init__(self, inner: EvictionPolicy, book: RetentionBook) -> None:
        self._inner = inner
        self._book = book
        self._ephemeral: dict[Key, None] = {}  # resident ephemeral keys, oldest first
        self._held: OrderedDict[Key, None] = OrderedDict()  # PIN and HIGH, least recent first

    def insert(self, key: Key) -> None:
        if key not in self._book.entries:  # the common case: a plain save
            self._inner.insert(key)
            return
        rank = self._book.rank(key)
        if rank > Priority.NORMAL:
            self._held[key] = None
            return
        self._inner.insert(key)
        if rank is Priority.EPHEMERAL:
            self._ephemeral[key] = None

    def touch(self, key: Key) -> None:
        if key in self._held:
            self._held.move_to_end(key)
        else:
            self._inner.touch(key)

    def remove(self, key: Key) -> None:
        if self._held.pop(key, 0) is None:
            return
        self._inner.remove(key)
        self._ephemeral.pop(key, None)

    def put_batch(self, keys: Sequence[Key]) -> None:
        self._inner.put_batch([k for k in keys if k not in self._held])

    def _take(self, key: Key) -> Key:
        self._inner.remove(key)
        self._ephemeral.pop(key, None)
        return key

    def _return_lapsed(self) -> None:
        """Move back to the inner policy the first few held keys whose protection lapsed
        (the others go to the end: a round robin over the held keys)."""
        rank = self._book.rank
        for _ in range(min(_LAPSE_CHECKS, len(self._held))):
            key = next(iter(self._held))
            if rank(key) <= Priority.NORMAL:
                del self._held[key]
                self._inner.insert(key)
            else:
                self._held.move_to_end(key)

    def evict(self, evictable: Callable[[Key], bool]) -> Key | None:
        book = self._book
        if not self._held and not book.entries and not book.any_expired:
            return self._inner.evict(evictable)
        for expired in book.expired_keys():
            if expired in self._inner and evictable(expired):
                return self._take(expired)
        stale = []
        for key in self._ephemeral:
            if not book.ephemeral(key):  # saved again since with a higher priority
                stale.append(key)
            elif evictable(key):
                return self._take(key)
        for key in stale:
            del self._ephemeral[key]
        if self._held:
            self._return_lapsed()
        rank = book.rank
        protected: list[Key] = []

        def normal(key: Key) -> bool:
            if rank(key) > Priority.NORMAL:
                protected.append(key)  # protected since it was inserted: held from now on
                return False
            return evictable(key)

        victim = self._inner.evict(normal)
        for key in protected:
            if key != victim and key in self._inner:
                self._inner.remove(key)
                self._held[key] = None
        if victim is not None:
            self._ephemeral.pop(victim, None)
            return victim
        for key in self._held:  # no NORMAL victim: the least recent HIGH one
            if rank(key) <= Priority.HIGH and evictable(key):
                del self._held[key]
                return key
        return None

    def __len__(self) -> int:
        return len(self._inner) + len(self._held)

    def __contains__(self, key: object) -> bool:
        return key in self._held or key in self._inner
