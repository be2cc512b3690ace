"""The eviction-policy interface shared by every tier that evicts single chunks."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Protocol

Key = Hashable


class EvictionPolicy(Protocol):
    """Tracks resident keys and names victims. Not thread-safe: the owning tier locks.

    ``evict(evictable)`` chooses a victim among keys for which ``evictable(key)`` is true,
    forgets it and returns it; it returns None when no key may be evicted (all pinned). Keys
    it skips stay resident.
    """

    def insert(self, key: Key) -> None: ...

    def touch(self, key: Key) -> None: ...

    def remove(self, key: Key) -> None: ...

    def evict(self, evictable: Callable[[Key], bool]) -> Key | None: ...

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...
