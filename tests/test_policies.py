import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.policy import (
    LRUPolicy,
    S3FIFOPolicy,
    SecondUseAdmission,
    make_admission_policy,
    make_eviction_policy,
    make_segment_policy,
)
from kvpool.policy.base import EvictionPolicy
from kvpool.policy.segments import SecondChanceSegments


def drain(policy: LRUPolicy | S3FIFOPolicy, pinned: frozenset[int] = frozenset()) -> list[object]:
    order = []
    while (victim := policy.evict(lambda k: k not in pinned)) is not None:
        order.append(victim)
    return order


def test_lru_exact_order() -> None:
    p = LRUPolicy()
    for i in range(1, 6):
        p.insert(i)
    p.touch(2)
    p.touch(4)
    p.insert(1)  # re-insert refreshes
    assert drain(p) == [3, 5, 2, 4, 1]


def test_lru_skips_pinned_and_keeps_them() -> None:
    p = LRUPolicy()
    for i in range(1, 6):
        p.insert(i)
    assert drain(p, pinned=frozenset({1, 3})) == [2, 4, 5]
    assert len(p) == 2 and 1 in p and 3 in p


def test_s3fifo_exact_order_protects_reused_keys() -> None:
    p = S3FIFOPolicy()
    for i in range(1, 11):
        p.insert(i)
    p.touch(2)
    p.touch(3)
    # One-hit keys leave through the small queue first; 2 and 3 were promoted to main.
    assert drain(p) == [1, 4, 5, 6, 7, 8, 9, 10, 2, 3]


def test_s3fifo_ghost_hit_goes_to_main() -> None:
    p = S3FIFOPolicy()
    for i in range(1, 11):
        p.insert(i)
    assert p.evict(lambda k: True) == 1
    p.insert(1)  # remembered in the ghost queue -> straight to main
    p.insert(11)
    assert drain(p) == [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1]


def test_s3fifo_is_scan_resistant() -> None:
    """A working set used twice per round survives scans of twice the cache size under
    S3-FIFO; LRU loses it to every scan and only hits the second use of each round."""
    capacity = 100

    def run(policy: LRUPolicy | S3FIFOPolicy) -> int:
        resident: set[int] = set()

        def access(key: int) -> bool:
            if key in resident:
                policy.touch(key)
                return True
            while len(resident) >= capacity:
                resident.discard(policy.evict(lambda k: True))  # type: ignore[arg-type]
            policy.insert(key)
            resident.add(key)
            return False

        hits = 0
        scan = 10_000
        for _round in range(5):
            for _use in range(2):
                for k in range(50):
                    hits += access(k)
            for _ in range(2 * capacity):
                scan += 1
                access(scan)
        return hits

    assert run(LRUPolicy()) == 5 * 50
    assert run(S3FIFOPolicy()) == 5 * 100 - 50


def test_s3fifo_all_pinned_returns_none() -> None:
    p = S3FIFOPolicy()
    for i in range(20):
        p.insert(i)
    p.touch(3)
    assert p.evict(lambda k: False) is None
    assert len(p) == 20


def evict_pinned_sevens(policy: EvictionPolicy, resident: set[int]) -> None:
    """One eviction while multiples of 7 are pinned: the victim is a resident unpinned key,
    or None only when every resident is pinned."""
    victim = policy.evict(lambda k: k % 7 != 0)  # type: ignore[operator]
    if victim is None:
        assert all(k % 7 == 0 for k in resident)
    else:
        assert victim in resident and victim % 7 != 0  # type: ignore[operator]
        resident.discard(victim)  # type: ignore[arg-type]


def assert_tracks(policy: EvictionPolicy, resident: set[int]) -> None:
    assert len(policy) == len(resident)
    assert all(k in policy for k in resident)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "touch", "remove", "evict"]),
                          st.integers(0, 30)), max_size=200),
       st.sampled_from(["lru", "s3fifo"]))
def test_policy_tracks_exactly_the_resident_set(ops: list[tuple[str, int]], name: str) -> None:
    policy = make_eviction_policy(name)
    resident: set[int] = set()
    for op, key in ops:
        if op == "insert":
            policy.insert(key)
            resident.add(key)
        elif op == "touch":
            policy.touch(key)
        elif op == "remove":
            policy.remove(key)
            resident.discard(key)
        else:
            evict_pinned_sevens(policy, resident)
        assert_tracks(policy, resident)


def test_second_use_admission() -> None:
    p = SecondUseAdmission(window=2)
    assert p.admit("a", hits=0) is False
    assert p.admit("a", hits=0) is True  # second offer
    assert p.admit("b", hits=3) is True  # read while in DRAM
    assert p.admit("c", hits=0) is False
    assert p.admit("d", hits=0) is False
    assert p.admit("e", hits=0) is False  # window 2: "c" forgotten
    assert p.admit("c", hits=0) is False
    assert make_admission_policy("always").admit("z", 0) is True


def test_second_chance_segments_budget() -> None:
    policy = SecondChanceSegments()
    hot = np.array([True, False, True, True, True])
    blocks = np.array([4, 4, 4, 4, 4])
    assert policy.copy_forward(hot, blocks, budget_blocks=8).tolist() == [0, 2]
    assert policy.copy_forward(hot, blocks, budget_blocks=0).tolist() == []
    assert make_segment_policy("fifo").copy_forward(hot, blocks, 100).tolist() == []


def test_unknown_policy_names() -> None:
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_eviction_policy("mru")
    with pytest.raises(ValueError, match="unknown admission"):
        make_admission_policy("never")
    with pytest.raises(ValueError, match="unknown SSD eviction"):
        make_segment_policy("lifo")
