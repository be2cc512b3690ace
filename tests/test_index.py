import os

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.ssd.index import CompactIndex, Location


def key(i: int) -> bytes:
    # Small key space with colliding low bits to exercise probing and tombstones.
    return (i % 5).to_bytes(8, "little") + i.to_bytes(8, "little")


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "remove", "get"]), st.integers(0, 3000),
                          st.integers(1, 100)), max_size=400))
def test_index_matches_dict(ops: list[tuple[str, int, int]]) -> None:
    index = CompactIndex()
    model: dict[bytes, Location] = {}
    for op, i, blocks in ops:
        k = key(i)
        if op == "put":
            index.put(k, i % 7, i, blocks, i % 3)
            model[k] = Location(i % 7, i, blocks, i % 3)
        elif op == "remove":
            assert index.remove(k) == model.pop(k, None)
        else:
            assert index.get(k) == model.get(k)
        assert len(index) == len(model)
    for k, loc in model.items():
        assert index.get(k) == loc


def test_growth_and_bytes_per_entry() -> None:
    index = CompactIndex()
    keys = [os.urandom(16) for _ in range(50_000)]
    for n, k in enumerate(keys):
        index.put(k, n % 16, n, 17, 0)
    assert len(index) == 50_000
    assert all(index.get(k) is not None for k in keys[::997])
    assert index.nbytes() / len(index) <= 64
    assert index.capacity * 0.85 >= len(index)


def test_segment_and_namespace_scans() -> None:
    index = CompactIndex()
    for i in range(100):
        index.put(key(i), i % 4, i, 1, i % 2)
    slots = index.slots_where(segment=1)
    assert sorted(index.key_at(int(s)) for s in slots) == sorted(key(i) for i in range(1, 100, 4))
    index.remove_slots(index.slots_where(ns_index=0))
    assert len(index) == 50
    assert all((key(i) in index) == (i % 2 == 1) for i in range(100))


def test_tombstones_are_reclaimed() -> None:
    index = CompactIndex()
    for round_ in range(20):
        for i in range(500):
            index.put(key(round_ * 1000 + i), 0, i, 1, 0)
        for i in range(500):
            index.remove(key(round_ * 1000 + i))
    assert len(index) == 0
    assert index.capacity <= 2048  # reused, not grown by deleted entries


def test_hot_bit_set_on_read_and_cleared_on_replace() -> None:
    index = CompactIndex()
    index.put(key(1), 0, 0, 1, 0)
    assert not index.column("hot")[index.slots_where(segment=0)[0]]
    index.get(key(1), mark_hot=True)
    assert index.column("hot")[index.slots_where(segment=0)[0]]
    index.put(key(1), 1, 5, 1, 0)
    assert not index.column("hot")[index.slots_where(segment=1)[0]]


def test_a_resize_keeps_every_entry_and_hot_bit_and_drops_tombstones() -> None:
    """The (vectorised) resize under long probe runs: keys with one home slot, the last one
    of the old table and of the new (their runs wrap round to slot 0), and clustered ones."""
    index = CompactIndex()
    index.reserve(10_000)
    last = 2 * index.capacity - 1  # the last slot of this table and of the next
    keys = [last.to_bytes(8, "little") + i.to_bytes(8, "little") for i in range(300)]
    keys += [key(i) for i in range(3000)] + [os.urandom(16) for _ in range(3000)]
    for n, k in enumerate(keys):
        index.put(k, n % 7, n, 1 + n % 5, n % 3)
    for k in keys[::4]:
        index.remove(k)
    for k in keys[1::4]:
        index.get(k, mark_hot=True)
    index.reserve(20_000)
    assert index.capacity == last + 1
    assert len(index) == len(keys) - len(keys[::4])
    for n, k in enumerate(keys):
        assert index.get(k) == (None if n % 4 == 0 else Location(n % 7, n, 1 + n % 5, n % 3))
    assert int(index.column("hot").sum()) == len(keys[1::4])
    assert int(index.slots_where().size) == len(index)  # no tombstone left
