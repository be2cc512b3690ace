import os
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtest import CHUNK, byte_namespace, payload_for

from kvpool.errors import ChunkSizeError, PoolClosedError
from kvpool.keys import Namespace
from kvpool.ssd.directio import buffer_address
from kvpool.tiers.arena import SlotArena
from kvpool.tiers.dram import DramTier

SLAB = 4 * CHUNK  # four 64 KiB slots per slab


class Recorder:
    """Demotion sink that checks each victim's bytes while they are still valid."""

    def __init__(self) -> None:
        self.evicted: list[bytes] = []
        self.bad = 0

    def demote(self, key: bytes, ns: Namespace, view: memoryview, hits: int,
               on_lower: bool) -> None:
        self.evicted.append(key)
        if not np.array_equal(np.frombuffer(view, np.uint8), payload_for(key, view.nbytes)):
            self.bad += 1


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_arena_alloc_free_and_alignment() -> None:
    arena = SlotArena(2 * SLAB, SLAB)
    slots = [arena.alloc(CHUNK) for _ in range(8)]
    assert None not in slots and len(set(slots)) == 8
    assert all(s % 4096 == 0 for s in slots)  # type: ignore[operator]
    assert arena.alloc(CHUNK) is None  # hard bound
    arena.free(CHUNK, slots[3])  # type: ignore[arg-type]
    assert arena.alloc(CHUNK) == slots[3]
    with pytest.raises(ValueError, match="slab_size"):
        arena.slot_size_for(SLAB + 1)
    with pytest.raises(ValueError, match="smaller than one"):
        SlotArena(SLAB - 4096, SLAB)


def test_roundtrip_and_bad_buffers() -> None:
    ns = byte_namespace()
    tier = DramTier(SLAB, SLAB, "lru")
    data = payload_for(k(1))
    assert tier.put(k(1), ns, data)
    out = np.zeros(CHUNK, np.uint8)
    assert tier.get_into(k(1), out) and np.array_equal(out, data)
    assert not tier.get_into(k(2), out)
    with pytest.raises(ChunkSizeError):
        tier.get_into(k(1), np.zeros(CHUNK - 1, np.uint8))
    with pytest.raises(ValueError, match="read-only"):
        tier.get_into(k(1), bytes(CHUNK))
    with pytest.raises(ValueError, match="contiguous"):
        tier.get_into(k(1), np.zeros((CHUNK, 2), np.uint8)[:, 0])
    tier.close()
    with pytest.raises(PoolClosedError):
        tier.get_into(k(1), out)


def test_capacity_bound_and_exact_lru_victims() -> None:
    ns = byte_namespace()
    rec = Recorder()
    tier = DramTier(SLAB, SLAB, "lru", demote=rec)
    for i in range(4):
        tier.put(k(i), ns, payload_for(k(i)))
    out = np.zeros(CHUNK, np.uint8)
    tier.get_into(k(0), out)
    for i in range(4, 8):
        tier.put(k(i), ns, payload_for(k(i)))
    assert rec.evicted == [k(1), k(2), k(3), k(0)]
    assert rec.bad == 0
    stats = tier.stats()
    assert stats["entries"] == 4 and stats["used_bytes"] <= tier.capacity
    assert stats["evictions"] == 4


def test_many_puts_stay_within_capacity_and_hook_sees_true_bytes() -> None:
    ns = byte_namespace()
    rec = Recorder()
    tier = DramTier(2 * SLAB, SLAB, "s3fifo", demote=rec)
    for i in range(100):
        assert tier.put(k(i), ns, payload_for(k(i)))
        assert tier.stats()["used_bytes"] <= 2 * SLAB
    assert len(rec.evicted) == 92 and rec.bad == 0
    out = np.zeros(CHUNK, np.uint8)
    survivors = [i for i in range(100) if tier.get_into(k(i), out)]
    assert len(survivors) == 8
    assert tier.contains_many([k(i) for i in survivors] + [k(0)], ns.id) == [True] * 8 + [False]


def test_pinned_view_blocks_eviction_and_survives_delete() -> None:
    ns = byte_namespace()
    tier = DramTier(SLAB, SLAB, "lru", put_wait_s=0.05)
    for i in range(4):
        tier.put(k(i), ns, payload_for(k(i)))
    view = tier.view(k(0))
    assert view is not None
    assert buffer_address(view.data) % 4096 == 0
    for i in range(4, 7):
        tier.put(k(i), ns, payload_for(k(i)))
    assert tier.contains(k(0))  # pinned: skipped by eviction
    assert tier.delete(k(0)) and not tier.contains(k(0))
    tier.put(k(7), ns, payload_for(k(7)))  # must not reuse the pinned slot
    assert np.array_equal(np.frombuffer(view.data, np.uint8), payload_for(k(0)))
    view.release()
    with pytest.raises(ValueError):
        bytes(view.data)  # released views are unusable


def test_all_pinned_put_is_dropped_not_blocked() -> None:
    ns = byte_namespace()
    tier = DramTier(SLAB, SLAB, "s3fifo", put_wait_s=0.05)
    views = []
    for i in range(4):
        tier.put(k(i), ns, payload_for(k(i)))
        views.append(tier.view(k(i)))
    assert tier.put(k(9), ns, payload_for(k(9))) is False
    assert tier.stats()["dropped_puts"] == 1
    with views[0]:
        pass
    assert tier.put(k(9), ns, payload_for(k(9))) is True


def test_a_batch_pin_holds_its_slots_until_released_and_counts_like_views() -> None:
    ns, other = byte_namespace(), byte_namespace(salt="other")
    tier = DramTier(SLAB, SLAB, "lru", put_wait_s=0.05)
    for i in range(3):
        tier.put(k(i), ns, payload_for(k(i)))
    tier.put(k(3), other, payload_for(k(3)))
    batch = tier.pin_batch([k(0), k(9), k(3), k(2)], ns.id)  # absent; another namespace's
    assert batch.pinned == 2 and [v is None for v in batch.views] == [False, True, True, False]
    assert [o is None for o in batch.offsets] == [False, True, True, False]
    # Reads are counted when the batch is released (a node's GET sends first).
    assert tier.stats()["hits"] == 0 and tier.stats()["misses"] == 0  # misses never counted
    # Offsets only (a host pool's attached read): the same slots, pinned and counted alike.
    offsets_only = tier.pin_batch([k(2), k(9)], ns.id, views=False)
    assert offsets_only.views == [] and offsets_only.offsets == [batch.offsets[3], None]
    assert offsets_only.pinned == 1 and tier.stats()["hits"] == 0
    offsets_only.release()
    assert tier.stats()["hits"] == 1
    for i in range(4, 8):  # evicts everything but the two pinned slots
        tier.put(k(i), ns, payload_for(k(i)))
    assert tier.contains(k(0)) and tier.contains(k(2))
    assert tier.delete(k(0))  # doomed while pinned: its slot is freed at the release
    tier.put(k(8), ns, payload_for(k(8)))  # must not reuse the pinned slot
    view0, view2 = batch.views[0], batch.views[3]
    assert view0 is not None and view2 is not None and view0.readonly
    assert np.array_equal(np.frombuffer(view0, np.uint8), payload_for(k(0)))
    assert np.array_equal(np.frombuffer(view2, np.uint8), payload_for(k(2)))
    batch.release()
    batch.release()  # idempotent: the pins are given back (and the reads counted) once
    assert tier.stats()["hits"] == 3
    with pytest.raises(ValueError):
        bytes(view0)  # released views are unusable
    # unpinned: evictable again (the release made it the most recently used: four puts)
    assert all(tier.put(k(i), ns, payload_for(k(i))) for i in range(10, 14))
    assert not tier.contains(k(2))
    tier.close()
    with pytest.raises(PoolClosedError):
        tier.pin_batch([k(10)], ns.id)


def test_a_batch_read_is_touched_in_the_policy_when_released_unless_deleted_meanwhile() -> None:
    ns = byte_namespace()
    tier = DramTier(SLAB, SLAB, "lru", put_wait_s=0.05)
    for i in range(4):  # the slab's four slots, k(0) the least recently used
        tier.put(k(i), ns, payload_for(k(i)))
    batch = tier.pin_batch([k(0), k(1)], ns.id)
    assert tier.delete(k(1))  # doomed while pinned
    batch.release()  # k(0) is now the most recently used; k(1) is gone, not touched back
    assert not tier.contains(k(1))
    tier.put(k(4), ns, payload_for(k(4)))  # takes k(1)'s freed slot: no eviction
    tier.put(k(5), ns, payload_for(k(5)))  # evicts the least recently used: k(2), not k(0)
    assert tier.contains(k(0)) and not tier.contains(k(2)) and tier.contains(k(3))
    assert tier.stats()["hits"] == 2
    tier.close()


def test_a_batch_release_wakes_a_put_waiting_for_a_pinned_slot() -> None:
    ns = byte_namespace()
    tier = DramTier(SLAB, SLAB, "lru", put_wait_s=60.0)
    for i in range(4):
        tier.put(k(i), ns, payload_for(k(i)))
    batch = tier.pin_batch([k(i) for i in range(4)], ns.id)
    stored: list[bool] = []
    waiter = threading.Thread(target=lambda: stored.append(tier.put(k(9), ns,
                                                                   payload_for(k(9)))))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()  # every slot pinned: the put waits
    batch.release()
    waiter.join(30.0)  # woken by the release, not by its 60 s deadline
    assert not waiter.is_alive() and stored == [True]


def test_slab_is_stolen_for_a_new_size_class() -> None:
    small, big = byte_namespace(CHUNK), byte_namespace(2 * CHUNK, model="big")
    rec = Recorder()
    tier = DramTier(2 * SLAB, SLAB, "lru", demote=rec)
    for i in range(8):
        tier.put(k(i), small, payload_for(k(i)))
    assert tier.put(k(100), big, payload_for(k(100), 2 * CHUNK))
    stats = tier.stats()
    assert stats["slab_steals"] == 1
    assert len(rec.evicted) == 4 and rec.bad == 0
    out = np.zeros(2 * CHUNK, np.uint8)
    assert tier.get_into(k(100), out) and np.array_equal(out, payload_for(k(100), 2 * CHUNK))
    assert stats["used_bytes"] <= 2 * SLAB


def test_a_slab_with_a_slot_still_being_filled_is_never_stolen() -> None:
    """A reserved slot (a promotion, a warm start or a network receive filling it in place)
    is neither a resident nor free: stealing its slab would hand the same memory to a chunk
    of another size, and the reservation's commit would then publish another chunk's bytes
    (found by the pool's differential test, a warm start racing the puts)."""
    small, big = byte_namespace(CHUNK), byte_namespace(2 * CHUNK, model="big")
    rec = Recorder()
    tier = DramTier(2 * SLAB, SLAB, "lru", demote=rec)
    slot = tier.reserve(k(50), small, CHUNK)  # the first slab's first slot, being filled
    assert slot is not None and not isinstance(slot, bool)
    for i in range(7):  # both slabs to the small class: 7 residents beside the reservation
        tier.put(k(i), small, payload_for(k(i)))
    # A big chunk needs a slab: only the one without the reservation may be stolen.
    assert tier.put(k(100), big, payload_for(k(100), 2 * CHUNK))
    slot.view[:] = payload_for(k(50))
    assert slot.commit()
    for i in range(101, 104):  # fill the big class's slab: no slot may be the reserved one
        tier.put(k(i), big, payload_for(k(i), 2 * CHUNK))
    out, big_out = np.zeros(CHUNK, np.uint8), np.zeros(2 * CHUNK, np.uint8)
    assert tier.get_into(k(50), out) and np.array_equal(out, payload_for(k(50)))
    for i in range(100, 104):
        if tier.get_into(k(i), big_out):
            assert np.array_equal(big_out, payload_for(k(i), 2 * CHUNK)), i
    for i in range(7):
        if tier.get_into(k(i), out):
            assert np.array_equal(out, payload_for(k(i))), i
    assert rec.bad == 0


def test_an_emptied_size_class_gives_its_slabs_to_a_growing_one() -> None:
    small, big = byte_namespace(CHUNK), byte_namespace(2 * CHUNK, model="big")
    rec = Recorder()
    tier = DramTier(4 * SLAB, SLAB, "lru", demote=rec)
    for i in range(12):  # three slabs of small chunks
        tier.put(k(i), small, payload_for(k(i)))
    assert tier.invalidate(small.id) == 12
    for i in range(8):  # four slabs' worth of big chunks: all four must be usable
        assert tier.put(k(100 + i), big, payload_for(k(100 + i), 2 * CHUNK))
    assert rec.evicted == []  # nothing was evicted: idle slabs moved instead
    assert tier.contains_many([k(100 + i) for i in range(8)], big.id) == [True] * 8


def test_invalidate_namespace() -> None:
    a, b = byte_namespace(model="a"), byte_namespace(model="b")
    tier = DramTier(2 * SLAB, SLAB)
    for i in range(3):
        tier.put(k(i), a, payload_for(k(i)))
        tier.put(k(10 + i), b, payload_for(k(10 + i)))
    assert tier.invalidate(a.id) == 3
    assert tier.contains_many([k(0), k(10)], a.id) == [False, False]
    assert tier.contains_many([k(0), k(10)], b.id) == [False, True] and tier.contains(k(10))


def test_threads_never_read_wrong_bytes() -> None:
    ns = byte_namespace()
    tier = DramTier(2 * SLAB, SLAB, "s3fifo")
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        out = np.zeros(CHUNK, np.uint8)
        for _ in range(300):
            key = k(int(rng.integers(0, 40)))
            if rng.random() < 0.5:
                tier.put(key, ns, payload_for(key))
            elif tier.get_into(key, out) and not np.array_equal(out, payload_for(key)):
                errors.append(key.hex())

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert tier.stats()["used_bytes"] <= 2 * SLAB


def test_shared_memory_arena(tmp_path: object) -> None:
    path = f"/dev/shm/kvpool-test-{os.getpid()}"
    tier = DramTier(SLAB, SLAB, shm_path=path)
    assert os.path.exists(path)
    tier.put(k(1), byte_namespace(), payload_for(k(1)))
    with open(path, "rb") as f:
        assert payload_for(k(1)).tobytes() in f.read()
    tier.close()
    assert not os.path.exists(path)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free"]), st.sampled_from([1, 2, 3]),
                          st.integers(0, 1000)), max_size=300))
def test_arena_never_overlaps_or_exceeds_capacity(ops: list[tuple[str, int, int]]) -> None:
    """Random allocs and frees across three size classes: live slots never overlap, stay
    page-aligned inside the arena, and a class only fails when no slab is left for it."""
    arena = SlotArena(4 * SLAB, SLAB)
    live: dict[int, int] = {}  # offset -> slot size
    for op, units, pick in ops:
        size = units * CHUNK
        if op == "alloc":
            offset = arena.alloc(size)
            if offset is None:
                cls = arena.size_class(size)
                assert not cls.free and len(cls.slabs) + sum(
                    len(c.slabs) for s, c in arena.classes.items() if s != size) == 4
                continue
            assert offset % 4096 == 0 and offset + size <= arena.capacity
            assert all(offset + size <= o or o + s <= offset for o, s in live.items())
            live[offset] = size
        elif live:
            offset = sorted(live)[pick % len(live)]
            arena.free(live.pop(offset), offset)
    for size, cls in arena.classes.items():
        assert cls.used == sum(1 for s in live.values() if s == size)


@pytest.mark.parametrize("eviction", ["lru", "arc", "prefix"])
def test_batch_pins_racing_puts_and_deletes_keep_bytes_counts_and_slots(eviction: str) -> None:
    """Readers pin batches, check every pinned view's bytes and release (the release counts
    and touches), while a writer puts (evicting) and deletes the same keys: no pinned view
    ever shows other bytes, every pin is counted once, and afterwards every slot is free
    again (a fresh fill of the whole arena stays resident)."""
    ns = byte_namespace()
    tier = DramTier(2 * SLAB, SLAB, eviction, put_wait_s=0.01)
    pinned = [0, 0, 0]
    bad: list[bytes] = []
    stop = threading.Event()

    def reader(r: int) -> None:
        rng = np.random.default_rng(r)
        for _ in range(1500):
            keys = [k(int(i)) for i in rng.integers(0, 16, 3)]
            batch = tier.pin_batch(keys, ns.id)
            for key, view in zip(keys, batch.views, strict=True):
                if view is not None and not np.array_equal(np.frombuffer(view, np.uint8),
                                                           payload_for(key)):
                    bad.append(key)
            pinned[r] += batch.pinned
            batch.release()

    def writer() -> None:
        rng = np.random.default_rng(99)
        while not stop.is_set():
            key = k(int(rng.integers(0, 16)))
            if rng.random() < 0.3:
                tier.delete(key)
            else:
                tier.put(key, ns, payload_for(key))

    w = threading.Thread(target=writer)
    readers = [threading.Thread(target=reader, args=(r,)) for r in range(3)]
    w.start()
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    stop.set()
    w.join()
    assert not bad
    assert tier.stats()["hits"] == sum(pinned) > 0
    for i in range(16):
        tier.delete(k(i))
    fresh = [k(100 + i) for i in range(8)]  # the arena's eight slots
    for key in fresh:
        assert tier.put(key, ns, payload_for(key))
    assert all(tier.contains(key) for key in fresh)  # no slot was left pinned or leaked
    tier.close()
