"""Retention around any eviction policy: the policy orders victims, this wrapper says which
it may not take and which go first (DESIGN: policy objects apart from the byte movers).

Victims are sought in passes: a chunk whose TTL passed, then an ephemeral chunk (oldest
first), then what the inner policy picks among NORMAL chunks, and only when none of those can
go, among HIGH ones. A pinned chunk (PIN until its deadline or its session's release) is never
a victim; a tier full of pins drops the save, as it does for chunks pinned by readers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpool.policy.base import EvictionPolicy, Key
from kvpool.retention.book import RetentionBook
from kvpool.retention.spec import Priority


class RetainingPolicy(EvictionPolicy):
    """Wraps ``inner`` (one per DRAM size class) with ``book``'s retention."""

    def __init__(self, inner: EvictionPolicy, book: RetentionBook) -> None:
        self._inner = inner
        self._book = book
        self._ephemeral: dict[Key, None] = {}  # resident ephemeral keys, oldest first

    def insert(self, key: Key) -> None:
        self._inner.insert(key)
        if isinstance(key, bytes) and self._book.ephemeral(key):
            self._ephemeral[key] = None

    def touch(self, key: Key) -> None:
        self._inner.touch(key)

    def remove(self, key: Key) -> None:
        self._inner.remove(key)
        self._ephemeral.pop(key, None)

    def put_batch(self, keys: Sequence[Key]) -> None:
        self._inner.put_batch(keys)

    def _take(self, key: Key) -> Key:
        self._inner.remove(key)
        self._ephemeral.pop(key, None)
        return key

    def evict(self, evictable: Callable[[Key], bool]) -> Key | None:
        book = self._book
        if not len(book) and not book.any_expired:
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
        rank = book.rank
        victim = self._inner.evict(lambda k: rank(k) <= Priority.NORMAL and evictable(k))
        if victim is None:
            victim = self._inner.evict(lambda k: rank(k) <= Priority.HIGH and evictable(k))
        if victim is not None:
            self._ephemeral.pop(victim, None)
        return victim

    def __len__(self) -> int:
        return len(self._inner)

    def __contains__(self, key: object) -> bool:
        return key in self._inner
