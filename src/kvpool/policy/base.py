"""The eviction-policy interface shared by every tier that evicts single chunks."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

Key = Hashable


class EvictionPolicy(Protocol):
    """Tracks resident keys and names victims. Not thread-safe: the owning tier locks.

    ``evict(evictable)`` chooses a victim among keys for which ``evictable(key)`` is true,
    forgets it and returns it; it returns None when no key may be evicted (all pinned). Keys
    it skips stay resident.

    ``put_batch(keys)`` follows the inserts (or touches, for keys already resident) of one
    batched put, with the keys in prefix order (each the parent of the next): a hint a
    prefix-aware policy may use to order them. The default ignores it, so a policy that
    subclasses this protocol and does not override it evicts as if the keys came one by one.
    """

    def insert(self, key: Key) -> None: ...

    def touch(self, key: Key) -> None: ...

    def remove(self, key: Key) -> None: ...

    def evict(self, evictable: Callable[[Key], bool]) -> Key | None: ...

    def put_batch(self, keys: Sequence[Key]) -> None:
        return None

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...
