import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvtest import CHUNK, byte_namespace, payload_for, small_config

from kvpool import KVPool
from kvpool.errors import ChunkSizeError, PoolClosedError, UnknownNamespaceError
from kvpool.keys import Namespace
from kvpool.pool import ChunkReservation


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def read(pool: KVPool, ns: Namespace, key: bytes) -> np.ndarray | None:
    out = np.zeros(ns.chunk_bytes, np.uint8)
    return out if pool.get_into(ns, key, out) else None


def test_put_get_lookup_across_tiers(tmp_path: Path) -> None:
    ns = byte_namespace()
    with KVPool(small_config(tmp_path)) as pool:  # DRAM holds 16 chunks
        pool.register_namespace(ns)
        keys = [k(i) for i in range(40)]
        assert pool.put_many(ns, keys, [payload_for(x) for x in keys]) == 40
        pool.flush()
        assert pool.lookup(ns, keys) == 40
        for x in keys:
            got = read(pool, ns, x)
            assert got is not None and np.array_equal(got, payload_for(x))
        pool.flush()  # promotions run in the background
        stats = pool.stats()
        assert stats["pool"]["ssd_hits"] > 0 and stats["pool"]["promotions"] > 0
        assert stats["dram"]["used_bytes"] <= stats["dram"]["capacity_bytes"]
        assert pool.delete(ns, keys[5])
        assert pool.lookup(ns, keys) == 5
        assert read(pool, ns, keys[5]) is None
        assert not pool.delete(ns, keys[5])


def test_get_many_into(tmp_path: Path) -> None:
    ns = byte_namespace()
    with KVPool(small_config(tmp_path)) as pool:
        pool.register_namespace(ns)
        keys = [k(i) for i in range(30)]
        pool.put_many(ns, keys[:25], [payload_for(x) for x in keys[:25]])
        pool.flush()
        outs = [np.zeros(CHUNK, np.uint8) for _ in keys]
        found = pool.get_many_into(ns, keys, outs)
        assert found == [True] * 25 + [False] * 5
        assert all(np.array_equal(o, payload_for(x)) for o, x in zip(outs[:25], keys[:25],
                                                                     strict=True))


def test_misuse_raises_clear_errors(tmp_path: Path) -> None:
    ns, other = byte_namespace(), byte_namespace(model="never-registered")
    pool = KVPool(small_config(tmp_path))
    pool.register_namespace(ns)
    with pytest.raises(UnknownNamespaceError, match="register_namespace"):
        pool.put(other, k(1), payload_for(k(1)))
    with pytest.raises(UnknownNamespaceError):
        pool.lookup(other, [k(1)])
    with pytest.raises(ChunkSizeError, match=str(CHUNK)):
        pool.put(ns, k(1), np.zeros(CHUNK + 1, np.uint8))
    pool.put(ns, k(1), payload_for(k(1)))
    with pytest.raises(ChunkSizeError):
        pool.get_into(ns, k(1), np.zeros(100, np.uint8))
    with pytest.raises(ValueError, match="16 bytes"):
        pool.put(ns, b"short", payload_for(k(1)))
    with pytest.raises(ValueError, match="chunk of"):
        pool.register_namespace(byte_namespace(8 << 20, model="huge"))
    pool.close()
    pool.close()  # idempotent
    with pytest.raises(PoolClosedError):
        pool.get_into(ns, k(1), np.zeros(CHUNK, np.uint8))
    with pytest.raises(PoolClosedError):
        pool.put(ns, k(2), payload_for(k(2)))


def test_tenants_and_models_never_share_hits(tmp_path: Path) -> None:
    a, b = byte_namespace(salt="tenant-a"), byte_namespace(salt="tenant-b")
    c = byte_namespace(model="other-model", salt="tenant-a")
    tokens = list(range(8))
    with KVPool(small_config(tmp_path)) as pool:
        for ns in (a, b, c):
            pool.register_namespace(ns)
        keys = a.chunk_keys(tokens)
        pool.put_many(a, keys, [payload_for(x) for x in keys])
        assert pool.lookup(a, a.chunk_keys(tokens)) == 8
        assert pool.lookup(b, b.chunk_keys(tokens)) == 0
        assert pool.lookup(c, c.chunk_keys(tokens)) == 0


def test_write_through_survives_restart_and_invalidate_persists(tmp_path: Path) -> None:
    ns, keep = byte_namespace(), byte_namespace(model="kept")
    cfg = small_config(tmp_path, pool={"ssd_write": "through"})
    with KVPool(cfg) as pool:
        pool.register_namespace(ns)
        pool.register_namespace(keep)
        pool.put_many(ns, [k(i) for i in range(10)], [payload_for(k(i)) for i in range(10)])
        pool.put(keep, k(99), payload_for(k(99)))
    with KVPool(cfg) as pool:
        pool.register_namespace(ns)
        pool.register_namespace(keep)
        assert pool.lookup(ns, [k(i) for i in range(10)]) == 10
        got = read(pool, ns, k(3))
        assert got is not None and np.array_equal(got, payload_for(k(3)))
        assert pool.invalidate(ns) >= 10
        assert pool.lookup(ns, [k(i) for i in range(10)]) == 0
    with KVPool(cfg) as pool:
        pool.register_namespace(ns)
        pool.register_namespace(keep)
        assert pool.lookup(ns, [k(i) for i in range(10)]) == 0
        assert pool.contains(keep, k(99))


def test_ssd_only_and_dram_only_pools(tmp_path: Path) -> None:
    ns = byte_namespace()
    for sections in ({"dram": {"capacity": 0}}, {"ssd": {"enabled": False}}):
        with KVPool(small_config(tmp_path / str(len(sections)), **sections)) as pool:
            pool.register_namespace(ns)
            assert pool.put(ns, k(1), payload_for(k(1)))
            pool.flush()
            got = read(pool, ns, k(1))
            assert got is not None and np.array_equal(got, payload_for(k(1)))
            tiers = set(pool.stats())
            assert ("dram" in tiers) != ("ssd" in tiers)


def test_second_use_admission_skips_one_hit_chunks(tmp_path: Path) -> None:
    ns = byte_namespace()
    cfg = small_config(tmp_path, ssd={"admission": "second_use"}, dram={"eviction": "lru"},
                       pool={"ssd_write": "evict"})  # admission decides demotions only
    with KVPool(cfg) as pool:
        pool.register_namespace(ns)
        read_twice = [k(i) for i in range(4)]
        pool.put_many(ns, read_twice, [payload_for(x) for x in read_twice])
        for x in read_twice:
            assert read(pool, ns, x) is not None
        one_hit = [k(100 + i) for i in range(30)]
        pool.put_many(ns, one_hit, [payload_for(x) for x in one_hit])
        pool.flush()
        stats = pool.stats()
        assert stats["dram"]["evictions"] == 4 + 30 - 16
        assert stats["ssd"]["records"] == 4  # only the reused chunks were admitted
        assert all(pool.contains(ns, x) for x in read_twice)


def test_pin_many_gives_zero_copy_views_of_dram_chunks(tmp_path: Path) -> None:
    ns = byte_namespace()
    # evict: a put no DRAM slot takes is not stored anywhere (through would stage it to SSD)
    cfg = small_config(tmp_path, dram={"eviction": "lru", "put_wait_s": 0.01},
                       pool={"ssd_write": "evict"})
    with KVPool(cfg) as pool:
        pool.register_namespace(ns)
        keys = [k(i) for i in range(20)]  # DRAM holds 16: the first 4 were demoted
        pool.put_many(ns, keys, [payload_for(x) for x in keys])
        pool.flush()
        views = pool.pin_many(ns, [*keys, k(99)])
        assert [v is None for v in views] == [True] * 4 + [False] * 16 + [True]
        for x, v in zip(keys[4:], views[4:20], strict=True):
            assert v is not None and np.array_equal(np.frombuffer(v.data, np.uint8),
                                                    payload_for(x))
        # pinned slots survive pressure (those puts are dropped, not waited for); released
        # ones can go
        more = [k(200 + i) for i in range(16)]
        assert pool.put_many(ns, more, [payload_for(x) for x in more]) == 0
        assert pool.stats()["dram"]["dropped_puts"] == 16
        assert all(pool._front is not None and pool._front.contains(x) for x in keys[4:])
        for v in views:
            if v is not None:
                v.release()
        pool.put_many(ns, [k(300 + i) for i in range(16)],
                      [payload_for(k(300 + i)) for i in range(16)])
        assert not any(pool._front is not None and pool._front.contains(x) for x in keys[4:])


def test_prefetch_lifts_ssd_chunks_into_dram(tmp_path: Path) -> None:
    ns = byte_namespace()
    with KVPool(small_config(tmp_path, pool={"ssd_write": "through"})) as pool:
        pool.register_namespace(ns)
        keys = [k(i) for i in range(30)]  # 30 x 64 KiB: more than the 1 MiB arena
        for key in keys:
            assert pool.put(ns, key, payload_for(key))
        assert pool.flush(10)
        cold = [k for k in keys if pool.pin_many(ns, [k])[0] is None]
        assert len(cold) > 10
        future = pool.prefetch(ns, cold[:8])
        assert future is not None and future.result(10) == 8
        pins = pool.pin_many(ns, cold[:8])
        assert all(p is not None for p in pins)
        for key, pin in zip(cold, pins, strict=False):
            assert pin is not None and np.array_equal(np.frombuffer(pin.data, np.uint8),
                                                      payload_for(key))
            pin.release()
        assert pool.stats()["pool"]["prefetched"] == 8
        assert pool.prefetch(ns, cold[:8]) is None  # all resident: nothing to do


def test_a_read_after_a_failed_pin_counts_one_dram_miss(tmp_path: Path) -> None:
    # the node's GET and the engine loads pin first, then get_many_into what was not pinned
    ns = byte_namespace()
    with KVPool(small_config(tmp_path)) as pool:
        pool.register_namespace(ns)
        present = [k(i) for i in range(3)]
        pool.put_many(ns, present, [payload_for(x) for x in present])
        absent = [k(100 + i) for i in range(5)]
        pins = pool.pin_many(ns, [*present, *absent])
        assert [p is None for p in pins] == [False] * 3 + [True] * 5
        outs = [np.zeros(CHUNK, np.uint8) for _ in absent]
        assert pool.get_many_into(ns, absent, outs) == [False] * 5
        for p in pins:
            if p is not None:
                p.release()
        dram = pool.stats()["dram"]
        assert dram["misses"] == len(absent) and dram["hits"] == len(present)
        assert pool.stats()["pool"]["misses"] == len(absent)


def test_reserving_a_chunk_only_the_ssd_holds_says_stored_and_writes_nothing(
        tmp_path: Path) -> None:
    # An engine saving a prefix chunk that was demoted to SSD must not write it again.
    ns = byte_namespace()
    with KVPool(small_config(tmp_path, dram={"eviction": "lru"})) as pool:
        pool.register_namespace(ns)
        keys = [k(i) for i in range(24)]  # DRAM holds 16: the first 8 are demoted
        assert pool.put_many(ns, keys, [payload_for(x) for x in keys]) == 24
        assert pool.flush(10)
        on_ssd_only = [x for x in keys if pool.pin_many(ns, [x])[0] is None]
        assert len(on_ssd_only) == 8
        writes = pool.stats()["ssd"]["puts"]
        assert all(pool.reserve(ns, x) is True for x in on_ssd_only)
        assert pool.flush(10) and pool.stats()["ssd"]["puts"] == writes
        fresh = pool.reserve(ns, k(99))
        assert isinstance(fresh, ChunkReservation)
        fresh.abort()


@pytest.mark.parametrize("promote", [True, False])
def test_an_ssd_hit_is_promoted_in_the_background_only_if_asked(tmp_path: Path,
                                                                 promote: bool) -> None:
    ns = byte_namespace()
    cfg = small_config(tmp_path, dram={"eviction": "lru"}, pool={"promote_on_hit": promote})
    with KVPool(cfg) as pool:
        pool.register_namespace(ns)
        keys = [k(i) for i in range(20)]  # DRAM holds 16: the first 4 go to SSD
        pool.put_many(ns, keys, [payload_for(x) for x in keys])
        assert pool.flush(10)
        outs = [np.zeros(CHUNK, np.uint8) for _ in range(4)]
        assert pool.get_many_into(ns, keys[:4], outs) == [True] * 4
        assert all(np.array_equal(o, payload_for(x)) for o, x in zip(outs, keys, strict=False))
        assert pool.flush(10)
        pins = pool.pin_many(ns, keys[:4])
        assert [p is not None for p in pins] == [promote] * 4
        for pin, key in zip(pins, keys, strict=False):
            if pin is not None:
                assert np.array_equal(np.frombuffer(pin.data, np.uint8), payload_for(key))
                pin.release()
        stats = pool.stats()["pool"]
        assert stats["ssd_hits"] == 4  # the promotion's own reads are not counted as hits
        assert stats["promotions"] == (4 if promote else 0)


def test_prefetch_max_pending_from_the_config_skips_rather_than_queues(tmp_path: Path) -> None:
    ns = byte_namespace()
    cfg = small_config(tmp_path, dram={"eviction": "lru", "put_wait_s": 1.0},
                       pool={"prefetch_max_pending": 1})
    with KVPool(cfg) as pool:
        pool.register_namespace(ns)
        keys = [k(i) for i in range(24)]  # the first 8 end up on SSD only
        pool.put_many(ns, keys, [payload_for(x) for x in keys])
        assert pool.flush(10)
        pins = [p for p in pool.pin_many(ns, keys) if p is not None]  # every slot pinned
        assert len(pins) == 16
        first = pool.prefetch(ns, keys[:4])  # its move waits for a slot (put_wait_s)
        assert first is not None
        assert pool.prefetch(ns, keys[4:8]) is None  # one move queued already: skipped
        assert pool.stats()["pool"]["prefetch_skipped"] == 1
        for pin in pins:
            pin.release()
        assert first.result(10) >= 1


class _HeldReads:
    """Wraps a lower tier of a pool's mover: after a move's read it waits for ``go`` (this
    only controls when the background move resumes; the bytes come from the real tier)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.read_done, self.go = threading.Event(), threading.Event()

    def get_many_into(self, ns: Namespace, keys: Any, outs: Any) -> list[bool]:
        got = self.inner.get_many_into(ns, keys, outs)
        if any(got):  # this tier served the move
            self.read_done.set()
            self.go.wait(10)
        return list(got)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("removal", ["delete", "invalidate"])
def test_a_removal_during_a_promotion_does_not_bring_the_chunk_back(tmp_path: Path,
                                                                     removal: str) -> None:
    ns = byte_namespace()
    with KVPool(small_config(tmp_path, dram={"eviction": "lru"})) as pool:
        pool.register_namespace(ns)
        keys = [k(i) for i in range(20)]  # DRAM holds 16: the first 4 go to SSD
        pool.put_many(ns, keys, [payload_for(x) for x in keys])
        assert pool.flush(10)
        mover = pool._mover
        assert mover is not None
        held = [_HeldReads(t) for t in mover._lower]
        mover._lower = held  # type: ignore[assignment]
        assert pool.get_into(ns, keys[0], np.zeros(CHUNK, np.uint8))  # queues its promotion
        deadline = time.monotonic() + 10
        while not any(h.read_done.is_set() for h in held) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert any(h.read_done.is_set() for h in held)  # the move has read the chunk...
        if removal == "delete":
            assert pool.delete(ns, keys[0])  # ...and the chunk is deleted before it publishes
        else:
            assert pool.invalidate(ns) > 0
        for h in held:
            h.go.set()
        assert pool.flush(10)
        assert pool.pin_many(ns, [keys[0]]) == [None]
        assert not pool.get_into(ns, keys[0], np.zeros(CHUNK, np.uint8))
