"""The DRAM tier's bookkeeping, without bytes: which chunks are resident, and the calls
``kvpool.tiers.dram.DramTier`` makes on its eviction policy for the same operations.

The policy is kvpool's own object, made by ``kvpool.policy.make_eviction_policy`` from the same
name ``dram.eviction`` takes, so a policy added there is plannable with no change here. The
calls mirror DramTier one for one:

- ``read`` (a hit served by ``get_many_into``; DramTier ``_pin``): ``hits += 1``,
  ``policy.touch(key)``;
- ``put`` of a resident chunk (DramTier ``reserve`` finding it): ``on_lower |= ...``,
  ``policy.touch(key)``;
- ``put`` of a new chunk: when full, ``policy.evict(evictable)`` names the victim (nothing is
  ever pinned here, so every key is evictable), which goes to the demotion sink with its hit
  count and ``on_lower`` (DramTier ``_alloc_locked`` / ``_hand_over``); then
  ``policy.insert(key)`` (DramTier ``_commit``).
- the end of a batched put (``put_many`` / ``commit_many``; DramTier ``note_put_batch``): the
  batch's keys still resident, in prefix order, to ``policy.put_batch`` (batches of 2 or more).

Capacity is counted in chunks (the planner gives ``dram bytes // slot size``); DramTier's
rounding of the arena down to whole slabs is left out.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from kvpool.policy import EvictionPolicy, make_eviction_policy

#: Receives each victim: (key, hits while resident, already held by a lower tier).
DemoteSink = Callable[[int, int, bool], None]


def _always(key: Hashable) -> bool:
    return True


class DramModel:
    """Raises ValueError for an unknown policy name or a negative capacity."""

    def __init__(self, policy: str, capacity_chunks: int,
                 demote: DemoteSink | None = None) -> None:
        if capacity_chunks < 0:
            raise ValueError(f"DRAM capacity must be >= 0 chunks, got {capacity_chunks}")
        self.policy_name = policy
        self.policy: EvictionPolicy = make_eviction_policy(policy)
        self.capacity = capacity_chunks
        self._hits: dict[int, int] = {}
        self._on_lower: dict[int, bool] = {}
        self._demote = demote
        self.reads = 0
        self.writes = 0  # chunks stored (puts of new chunks and promotions)
        self.evictions = 0

    def __contains__(self, key: int) -> bool:
        return key in self._hits

    def __len__(self) -> int:
        return len(self._hits)

    def read(self, key: int) -> None:
        """A hit on a resident chunk. KeyError if it is not resident (a replay bug)."""
        self._hits[key] += 1
        self.reads += 1
        self.policy.touch(key)

    def put(self, key: int, on_lower: bool) -> None:
        """Store a chunk (or refresh a resident one), evicting by policy when full. With no
        capacity nothing is stored (a pool without DRAM)."""
        if key in self._hits:
            self._on_lower[key] |= on_lower
            self.policy.touch(key)
            return
        if self.capacity == 0:
            return
        if len(self._hits) >= self.capacity:
            victim = self.policy.evict(_always)
            if not isinstance(victim, int):
                return  # the policy refused with nothing pinned: dropped, as DramTier would
            hits = self._hits.pop(victim)
            low = self._on_lower.pop(victim)
            self.evictions += 1
            if self._demote is not None:
                self._demote(victim, hits, low)
        self._hits[key] = 0
        self._on_lower[key] = on_lower
        self.writes += 1
        self.policy.insert(key)

    def note_put_batch(self, keys: list[int]) -> None:
        """The batch just put, in prefix order (DramTier ``note_put_batch``)."""
        if len(keys) >= 2:
            self.policy.put_batch([k for k in keys if k in self._hits])
