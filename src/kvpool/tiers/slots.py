"""What the DRAM tier hands out: a pinned zero-copy view of a slot, and a slot reserved for a
chunk being filled in place. Both keep their slot out of eviction until released."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.keys import Namespace

if TYPE_CHECKING:
    from kvpool.tiers.dram import DramTier


@dataclass(slots=True)
class _Entry:
    offset: int
    slot_size: int
    nbytes: int
    ns: Namespace
    hits: int = 0
    pins: int = 0
    on_lower: bool = False
    doomed: bool = False  # deleted while pinned: free the slot at the last unpin
    ephemeral: bool = False  # retention: never demoted, never drained below DRAM


class PinnedView:
    """A zero-copy, read-only view of a DRAM slot. The slot cannot be evicted or reused until
    ``release()`` (or the end of a ``with`` block); using ``data`` after that is a bug."""

    __slots__ = ("_entry", "_released", "_tier", "data")

    def __init__(self, tier: DramTier, entry: _Entry, data: memoryview) -> None:
        self._tier, self._entry, self.data = tier, entry, data
        self._released = False

    @property
    def offset(self) -> int:
        """Where the slot starts in the arena (a host pool tells attached engines)."""
        return self._entry.offset

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.data.release()
            self._tier._unpin(self._entry)

    def __enter__(self) -> PinnedView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


class PinnedBatch:
    """The slots of a batch pinned under one lock acquisition (``DramTier.pin_batch``):
    ``offsets[i]`` where key i's slot starts in the arena, ``views[i]`` a read-only view of
    it (``views`` is empty when the batch was pinned for its offsets only), None where the
    key was not resident. One object per batch, not per key (a storage node's GET, a host
    pool's attached reads). The slots cannot be evicted or reused until ``release()``
    (idempotent; also run when collected), which also counts the reads (hits, policy
    recency) and then runs ``after_release`` (the pool's counts), if set; using a view or
    an offset after that is a bug."""

    __slots__ = ("_entries", "_keys", "_tier", "after_release", "offsets", "views")

    def __init__(self, tier: DramTier, entries: list[_Entry], keys: list[bytes],
                 offsets: list[int | None], views: list[memoryview | None]) -> None:
        self._tier, self._entries, self._keys = tier, entries, keys
        self.offsets, self.views = offsets, views
        #: Run once by ``release`` after the pins are given back (never raises there: a
        #: count); None: nothing.
        self.after_release: Callable[[], None] | None = None

    @property
    def pinned(self) -> int:
        """How many of the keys are pinned (resident)."""
        return len(self._entries)

    def release(self) -> None:
        entries, self._entries = self._entries, []
        if entries:
            for view in self.views:
                if view is not None:
                    view.release()
            self._tier.unpin_batch(entries, self._keys)
        after, self.after_release = self.after_release, None
        if after is not None:
            after()

    def __del__(self) -> None:
        self.release()


class SlotReservation:
    """A DRAM slot taken by ``DramTier.reserve`` and being filled in place through ``view``.
    Exactly one of ``commit()`` (publish the chunk) or ``abort()`` (free the slot) must follow;
    both are idempotent, and a reservation dropped without either frees its slot when
    collected."""

    __slots__ = ("_done", "_entry", "_key", "_tier", "view")

    def __init__(self, tier: DramTier, key: bytes, entry: _Entry, view: memoryview) -> None:
        self._tier, self._key, self._entry, self.view = tier, key, entry, view
        self._done = False

    @property
    def offset(self) -> int:
        """Where the slot starts in the arena (a host pool tells attached engines)."""
        return self._entry.offset

    def commit(self) -> bool:
        """Publish the chunk (True). Its bytes must be complete: readers see them at once."""
        if self._done:
            return True
        self._done = True
        self.view.release()
        return self._tier._commit(self._key, self._entry)

    def abort(self) -> None:
        """Give the slot back without publishing anything."""
        if not self._done:
            self._done = True
            self.view.release()
            self._tier._abort(self._entry)

    def __del__(self) -> None:
        self.abort()
