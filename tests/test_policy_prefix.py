"""The prefix-aware eviction policy (dram.eviction: prefix): exact orders on hand-made
sequences, through the policy object, the DRAM tier and a DRAM-only KVPool."""

from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtest import byte_namespace, payload_for, small_config
from test_policies import assert_tracks, evict_pinned_sevens

from kvpool import KVPool
from kvpool.keys import Namespace
from kvpool.policy import (
    EvictionPolicy,
    LRUPolicy,
    PrefixS3FIFOPolicy,
    S3FIFOPolicy,
    make_eviction_policy,
)
from kvpool.tiers.dram import DramTier


def drain(policy: EvictionPolicy) -> list[object]:
    order = []
    while (victim := policy.evict(lambda k: True)) is not None:
        order.append(victim)
    return order


def put(policy: EvictionPolicy, keys: list[int]) -> None:
    """What the DRAM tier does for one put_many: insert the new keys, touch the stored ones,
    then hand the batch over in prefix order."""
    for key in keys:
        if key in policy:
            policy.touch(key)
        else:
            policy.insert(key)
    policy.put_batch(keys)


def test_a_put_batch_is_evicted_tail_first() -> None:
    p = PrefixS3FIFOPolicy()
    put(p, [1, 2, 3, 4])
    put(p, [11, 12, 13])
    # The newest batch's deepest chunk goes first of all, then the batches oldest first,
    # each tail first. S3-FIFO would give 1, 2, 3, 4, 11, 12, 13.
    assert drain(p) == [13, 4, 3, 2, 1, 12, 11]


def test_a_hit_head_outlives_its_tail() -> None:
    p = PrefixS3FIFOPolicy()
    put(p, [1, 2, 3, 4])
    p.touch(1)
    p.touch(2)  # a later request hit the prefix's first two chunks
    assert drain(p) == [4, 3, 2, 1]  # 2 and 1 went to the main queue, 2 first (tail first)


def test_only_new_keys_of_a_batch_are_requeued() -> None:
    p = PrefixS3FIFOPolicy()
    put(p, [1, 2])  # S: 2, 1
    put(p, [5])  # a batch of one is plain S3-FIFO: S: 2, 1, 5
    put(p, [2, 3])  # 2 was stored (touched, not requeued); 3 is the new tail: goes first
    assert drain(p) == [3, 1, 5, 2]


def test_keys_back_from_the_ghost_queue_enter_main_tail_first() -> None:
    p = PrefixS3FIFOPolicy()
    put(p, [1, 2, 3])
    assert [p.evict(lambda k: True) for _ in range(3)] == [3, 2, 1]  # all three are ghosts
    put(p, [1, 2, 3, 4])  # 1, 2, 3 go straight to main (ghost hits), 4 is new in S
    assert drain(p) == [4, 3, 2, 1]


def test_evicted_or_removed_keys_in_a_batch_are_skipped() -> None:
    p = PrefixS3FIFOPolicy()
    for key in (1, 2, 3):
        p.insert(key)
    p.remove(2)
    p.put_batch([1, 2, 3, 99])  # 2 removed, 99 never inserted: no error, nothing resurrected
    assert len(p) == 2 and 2 not in p and 99 not in p
    assert drain(p) == [3, 1]


def test_lru_and_s3fifo_ignore_batches() -> None:
    for cls in (LRUPolicy, S3FIFOPolicy):
        plain, hinted = cls(), cls()
        for key in range(1, 9):
            plain.insert(key)
            hinted.insert(key)
        hinted.put_batch(list(range(1, 9)))
        assert drain(hinted) == drain(plain) == list(range(1, 9))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "touch", "remove", "evict"]),
                          st.integers(0, 30), st.integers(1, 5)), max_size=150))
def test_prefix_policy_tracks_exactly_the_resident_set(ops: list[tuple[str, int, int]]) -> None:
    policy = make_eviction_policy("prefix")
    resident: set[int] = set()
    for op, key, length in ops:
        if op == "put":
            keys = list(range(key, key + length))
            put(policy, keys)
            resident.update(keys)
        elif op == "touch":
            policy.touch(key)
        elif op == "remove":
            policy.remove(key)
            resident.discard(key)
        else:
            evict_pinned_sevens(policy, resident)
        assert_tracks(policy, resident)


# ---------------------------------------------------------------- through the DRAM tier
CHUNK = 64 << 10
SLAB = 4 * CHUNK


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


class Victims:
    def __init__(self) -> None:
        self.keys: list[bytes] = []

    def demote(self, key: bytes, ns: Namespace, view: memoryview, hits: int,
               on_lower: bool) -> None:
        self.keys.append(key)


def test_dram_tier_evicts_a_prefix_tail_before_its_head() -> None:
    ns = byte_namespace()
    for eviction, expected in (("prefix", [3, 2, 1, 0]), ("s3fifo", [0, 1, 2, 3])):
        victims = Victims()
        tier = DramTier(2 * SLAB, SLAB, eviction, demote=victims)  # 8 slots
        prefix = [k(i) for i in range(4)]
        assert tier.put_many([(key, ns, memoryview(payload_for(key))) for key in prefix]) \
            == [True] * 4
        for i in range(10, 18):  # 8 unrelated chunks, one put each: evict the 4 above
            assert tier.put(k(i), ns, payload_for(k(i)))
        assert victims.keys == [k(i) for i in expected], eviction
        tier.close()


def test_pool_keeps_a_prefix_head_under_pressure(tmp_path: Path) -> None:
    """DRAM-only pool of 16 chunks: a prefix of 6 saved by put_many, one of 6 by
    reserve_many + commit_many, then 8 unrelated chunks (4 evictions). prefix evicts the
    newer batch's tail, then the older batch from its tail: both heads stay (3 + 5 chunks
    found); s3fifo evicts the older prefix from its head: all of it is lost (0 + 6)."""
    ns = byte_namespace()
    found: dict[str, list[int]] = {}
    for eviction in ("prefix", "s3fifo"):
        config = small_config(tmp_path / eviction, ssd={"enabled": False},
                              dram={"eviction": eviction})
        with KVPool(config) as pool:
            pool.register_namespace(ns)
            saved = [k(i) for i in range(6)]
            assert pool.put_many(ns, saved, [payload_for(x) for x in saved]) == 6
            filled = [k(i) for i in range(100, 106)]
            slots = pool.reserve_many(ns, filled)
            for slot, key in zip(slots, filled, strict=True):
                assert not isinstance(slot, bool) and slot is not None
                np.frombuffer(slot.view, np.uint8)[:] = payload_for(key)
            assert pool.commit_many([s for s in slots if not isinstance(s, bool | None)]) == 6
            for i in range(200, 208):
                assert pool.put(ns, k(i), payload_for(k(i)))
            found[eviction] = [pool.lookup(ns, saved), pool.lookup(ns, filled)]
            out = np.zeros(ns.chunk_bytes, np.uint8)
            assert pool.get_into(ns, saved[0], out) == (eviction == "prefix")
    assert found == {"prefix": [3, 5], "s3fifo": [0, 6]}
