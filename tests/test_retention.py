"""Retention on an embedded pool (docs/retention.md): pins, priorities, ephemeral saves, TTL,
sessions, the pinned-bytes bound and tenant quotas. Real tiers on tmp_path; DRAM holds 16
chunks of 64 KiB (kvtest.small_config), the SSD 4 MiB."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from kvtest import CHUNK, byte_namespace, payload_for, small_config
from prometheus_client import generate_latest

from kvpool import KVPool
from kvpool.errors import ArgumentError, PinLimitError
from kvpool.keys import Namespace
from kvpool.retention import Priority, Retention, RetentionBook

PIN = Retention(Priority.PIN)
HIGH = Retention(Priority.HIGH)
EPHEMERAL = Retention(Priority.EPHEMERAL)


def keys(start: int, n: int, tag: int = 0) -> list[bytes]:
    return [(tag << 64 | i).to_bytes(16, "little") for i in range(start, start + n)]


def put(pool: KVPool, ns: Namespace, ks: list[bytes], retention: Retention | None = None) -> int:
    return pool.put_many(ns, ks, [payload_for(k) for k in ks], retention)


def in_dram(pool: KVPool, ns: Namespace, ks: list[bytes]) -> list[bool]:
    return pool.resident_many(ns, ks)


def readable(pool: KVPool, ns: Namespace, ks: list[bytes]) -> list[bool]:
    outs = [np.zeros(CHUNK, np.uint8) for _ in ks]
    found = pool.get_many_into(ns, ks, outs)
    for k, out, hit in zip(ks, outs, found, strict=True):
        if hit:
            assert np.array_equal(out, payload_for(k))
    return found


def dram_only(tmp_path: Path, **pool_cfg: object) -> KVPool:
    return KVPool(small_config(tmp_path, ssd={"enabled": False}, pool=dict(pool_cfg)))


def test_pinned_and_high_survive_a_flood_that_evicts_normal_and_ephemeral(
        tmp_path: Path) -> None:
    ns = byte_namespace()
    with dram_only(tmp_path) as pool:
        pool.register_namespace(ns)
        pinned, high = keys(0, 4, 1), keys(0, 4, 2)
        put(pool, ns, pinned, PIN)
        put(pool, ns, high, HIGH)
        for round_ in range(6):  # 6 x 8 chunks through the 8 slots left
            put(pool, ns, keys(round_ * 8, 4, 3), EPHEMERAL)
            put(pool, ns, keys(round_ * 8, 4, 4))
        assert all(in_dram(pool, ns, pinned))
        assert all(in_dram(pool, ns, high))
        assert pool.stats()["dram"]["evictions"] >= 40
        # once only pins and HIGH are left, HIGH goes, a pinned chunk never
        more_high = keys(0, 12, 5)
        assert put(pool, ns, more_high, HIGH) == 12
        assert all(in_dram(pool, ns, pinned))
        assert sum(in_dram(pool, ns, high + more_high)) == 12
        assert not any(in_dram(pool, ns, keys(40, 4, 4)))


def test_ephemeral_evicted_first_and_never_written_below_dram(tmp_path: Path) -> None:
    ns = byte_namespace()
    with KVPool(small_config(tmp_path, pool={"ssd_write": "through"})) as pool:
        pool.register_namespace(ns)
        normal, fleeting = keys(0, 8, 1), keys(0, 8, 2)
        put(pool, ns, normal)
        put(pool, ns, fleeting, EPHEMERAL)
        pool.flush()
        ssd = pool._stack.ssd
        assert ssd is not None
        assert not any(ssd.contains_many(fleeting, ns.id))
        assert all(ssd.contains_many(normal, ns.id))
        put(pool, ns, keys(0, 4, 3))  # DRAM is full: the ephemeral go first
        assert all(in_dram(pool, ns, normal))
        assert sum(in_dram(pool, ns, fleeting)) == 4
        put(pool, ns, keys(0, 16, 4))  # evicted ephemeral chunks are not demoted either
        pool.flush()
        assert not any(ssd.contains_many(fleeting, ns.id))
        assert not any(readable(pool, ns, fleeting))
    # nor written at close (the drain of DRAM-only chunks)
    with KVPool(small_config(tmp_path, pool={"ssd_write": "evict"})) as pool:
        pool.register_namespace(ns)
        put(pool, ns, keys(0, 4, 6), EPHEMERAL)
        put(pool, ns, keys(0, 4, 7))
    with KVPool(small_config(tmp_path, pool={"warm_start_fraction": 0})) as pool:
        pool.register_namespace(ns)
        assert readable(pool, ns, keys(0, 4, 7)) == [True] * 4
        assert readable(pool, ns, keys(0, 4, 6)) == [False] * 4


def test_pin_over_the_bound_is_refused_with_nothing_pinned(tmp_path: Path) -> None:
    ns = byte_namespace()
    with dram_only(tmp_path, max_pinned_fraction=0.25) as pool:  # 4 of 16 chunks
        pool.register_namespace(ns)
        assert put(pool, ns, keys(0, 3), PIN) == 3
        with pytest.raises(PinLimitError, match="max_pinned_fraction"):
            put(pool, ns, keys(3, 2), PIN)
        assert not any(readable(pool, ns, keys(3, 2)))  # refused: not stored either
        stats = pool.stats()["retention"]
        assert stats["pinned_bytes"] == 3 * CHUNK and stats["pins_refused"] == 1
        assert put(pool, ns, keys(0, 4), PIN) == 4  # three already pinned: one more fits
        assert pool.stats()["retention"]["pinned_bytes"] == 4 * CHUNK
    with dram_only(tmp_path, max_pinned_fraction=0) as pool:
        pool.register_namespace(ns)
        with pytest.raises(PinLimitError):
            put(pool, ns, keys(0, 1), PIN)


def test_pin_until_a_deadline_then_evictable(tmp_path: Path) -> None:
    ns = byte_namespace()
    with dram_only(tmp_path) as pool:
        pool.register_namespace(ns)
        pinned = keys(0, 4, 1)
        put(pool, ns, pinned, Retention(Priority.PIN, until=time.time() + 0.3))
        put(pool, ns, keys(0, 16, 2))
        assert all(in_dram(pool, ns, pinned))
        time.sleep(0.4)
        put(pool, ns, keys(16, 16, 2))
        assert not any(in_dram(pool, ns, pinned))
        assert pool.stats()["retention"]["pinned_bytes"] == 0


def test_ttl_makes_a_chunk_a_miss_in_every_tier(tmp_path: Path) -> None:
    ns = byte_namespace()
    with KVPool(small_config(tmp_path, pool={"ssd_write": "through"})) as pool:
        pool.register_namespace(ns)
        short, long_ = keys(0, 4, 1), keys(0, 4, 2)
        put(pool, ns, short, Retention(expires_at=time.time() + 0.3))
        put(pool, ns, long_, Retention(expires_at=time.time() + 60))
        pool.flush()
        assert pool.lookup(ns, short) == 4 and all(readable(pool, ns, short))
        time.sleep(0.4)
        # A batch pin (a node's GET, an attached read) checks the TTL of chunks still in DRAM.
        batch = pool.pin_resident(ns, short + long_, views=False)
        assert batch is not None and batch.offsets[:4] == [None] * 4
        assert None not in batch.offsets[4:] and batch.pinned == 4
        batch.release()
        assert pool.lookup(ns, short) == 0
        assert not any(pool.contains_many(ns, short))
        assert not any(readable(pool, ns, short))  # not from the SSD's copy either
        assert not any(in_dram(pool, ns, short))  # left DRAM when its deadline passed
        assert all(readable(pool, ns, long_))
        assert pool.expire() == 4  # the SSD's copies go too
        ssd = pool._stack.ssd
        assert ssd is not None and not any(ssd.contains_many(short, ns.id))
        assert pool.stats()["retention"]["expired"] == 4
        # saved again with an explicit default retention: wanted for ever again
        put(pool, ns, short, Retention())
        assert all(readable(pool, ns, short))


def test_release_session_unpins_and_deletes_only_what_no_one_else_holds(
        tmp_path: Path) -> None:
    ns = byte_namespace()
    with KVPool(small_config(tmp_path)) as pool:
        pool.register_namespace(ns)
        shared, mine, theirs = keys(0, 2, 1), keys(0, 3, 2), keys(0, 3, 3)
        put(pool, ns, shared + mine, Retention(Priority.PIN, session="a"))
        put(pool, ns, shared + theirs, Retention(Priority.PIN, session="b"))
        assert pool.stats()["retention"]["pinned_bytes"] == 8 * CHUNK
        assert pool.release("a", delete=True) == 3
        pool.flush()
        assert not any(readable(pool, ns, mine))
        assert all(readable(pool, ns, shared + theirs))
        assert pool.stats()["retention"]["pinned_bytes"] == 5 * CHUNK
        assert pool.release("b") == 5  # unpinned, kept
        assert pool.stats()["retention"]["pinned_bytes"] == 0
        assert all(readable(pool, ns, shared + theirs))
        assert pool.release("never-seen") == 0
        with pytest.raises(ArgumentError):
            pool.release("")


def test_namespace_default_retention(tmp_path: Path) -> None:
    system, chat = byte_namespace(model="system"), byte_namespace(model="chat")
    with dram_only(tmp_path) as pool:
        pool.register_namespace(system)
        pool.register_namespace(chat)
        pool.set_retention(system, PIN)
        prompt = keys(0, 4, 1)
        put(pool, system, prompt)
        for round_ in range(4):
            put(pool, chat, keys(round_ * 16, 16, 2))
        assert all(in_dram(pool, system, prompt))
        pool.set_retention(system, None)
        put(pool, system, keys(0, 2, 3))  # plain again (the pins already made stay)
        assert pool.stats()["retention"]["pinned_bytes"] == 4 * CHUNK


def test_tenant_at_its_quota_evicts_only_its_own_chunks(tmp_path: Path) -> None:
    acme, other = byte_namespace(salt="acme"), byte_namespace(salt="other:x")
    quotas = {"acme": {"dram_bytes": 4 * CHUNK}}
    with dram_only(tmp_path, tenant_quotas=quotas) as pool:
        pool.register_namespace(acme)
        pool.register_namespace(other)
        theirs = keys(0, 8, 1)
        put(pool, other, theirs)
        for round_ in range(5):  # 20 chunks of acme through its 4-chunk quota
            put(pool, acme, keys(round_ * 4, 4, 2))
        assert all(in_dram(pool, other, theirs))
        assert sum(in_dram(pool, acme, keys(0, 20, 2))) == 4
        tenants = pool.stats()["retention"]["tenants"]
        assert tenants["acme"]["dram_bytes"] == 4 * CHUNK
        assert tenants["acme"]["dram_quota_bytes"] == 4 * CHUNK
        assert tenants["other"]["dram_bytes"] == 8 * CHUNK
        # every acme chunk pinned: a further acme save is dropped, never another's evicted
        pool.delete(acme, keys(16, 4, 2)[0])
        assert put(pool, acme, keys(100, 1, 2), Retention(Priority.PIN)) == 1
        assert put(pool, acme, keys(200, 3, 2), Retention(Priority.PIN)) == 3
        assert put(pool, acme, keys(300, 2, 2)) == 0
        assert all(in_dram(pool, other, theirs))
        assert pool.stats()["retention"]["tenants"]["acme"]["quota_drops"] == 2
        # the other tenant, with no quota, still evicts by policy when DRAM is full
        assert put(pool, other, keys(0, 12, 3)) == 12
        scraped = generate_latest(pool.metrics).decode()
        assert 'kvpool_tenant_quota_drops_total{tenant="acme"} 2.0' in scraped
        assert 'kvpool_tenant_quota_bytes{tenant="acme",tier="dram"} 262144.0' in scraped
        assert f"kvpool_pinned_bytes {4.0 * CHUNK}" in scraped


def test_retention_parameters_from_engine_mappings() -> None:
    now = 1000.0
    r = Retention.from_mapping({"priority": "PIN", "pin_s": 30, "ttl_s": 60,
                                "session": "conv-1", "other": 1}, now=lambda: now)
    assert r == Retention(Priority.PIN, 1030.0, 1060.0, "conv-1")
    assert Retention.from_mapping(r.to_mapping()) == r
    assert Retention.from_mapping(None).is_default
    assert Retention.from_mapping({"priority": "ephemeral"}).ephemeral
    for bad in ({"priority": "urgent"}, {"ttl_s": -1}, {"ttl_s": "x"}, {"pin_until": True},
                {"session": 3}, {"ttl_s": float("inf")}):
        with pytest.raises(ArgumentError):
            Retention.from_mapping(bad)


def test_book_merges_saves_towards_the_stronger_retention() -> None:
    ns = byte_namespace()
    clock = [100.0]
    book = RetentionBook(10 * CHUNK, now=lambda: clock[0])
    key = keys(0, 1)
    book.apply(ns, key, Retention(Priority.HIGH, until=200.0, expires_at=150.0))
    book.apply(ns, key, Retention(Priority.EPHEMERAL, expires_at=180.0))
    assert book.rank(key[0]) is Priority.HIGH
    clock[0] = 160.0
    assert not book.expired(key[0])  # the later TTL holds
    book.apply(ns, key, Retention())  # no TTL: kept for ever
    clock[0] = 10_000.0
    assert not book.expired(key[0]) and book.rank(key[0]) is Priority.NORMAL


def test_tenant_at_its_ssd_quota_replaces_its_own_oldest_ssd_chunks(tmp_path: Path) -> None:
    acme, other = byte_namespace(salt="acme"), byte_namespace(salt="other")
    quotas = {"acme": {"ssd_bytes": 4 * CHUNK}}
    with KVPool(small_config(tmp_path, pool={"ssd_write": "through",
                                             "tenant_quotas": quotas})) as pool:
        pool.register_namespace(acme)
        pool.register_namespace(other)
        theirs = keys(0, 6, 1)
        put(pool, other, theirs)
        mine = keys(0, 10, 2)
        for i in range(0, 10, 2):
            put(pool, acme, mine[i:i + 2])
        pool.flush()
        ssd = pool._stack.ssd
        assert ssd is not None
        assert ssd.contains_many(mine, acme.id) == [False] * 6 + [True] * 4
        assert all(ssd.contains_many(theirs, other.id))
        tenants = pool.stats()["retention"]["tenants"]
        assert tenants["acme"]["ssd_bytes"] == 4 * CHUNK
        assert tenants["acme"]["ssd_quota_evictions"] == 6
        assert all(readable(pool, acme, mine[-4:]))


def test_retaining_policy_keeps_protected_keys_out_of_the_inner_policys_way() -> None:
    from kvpool.policy import LRUPolicy
    from kvpool.retention import RetainingPolicy

    ns = byte_namespace()
    clock = [0.0]
    book = RetentionBook(1 << 30, now=lambda: clock[0])
    policy = RetainingPolicy(LRUPolicy(), book)
    ks = keys(0, 6)
    book.apply(ns, ks[:1], Retention(Priority.PIN, until=10.0))
    for key in ks:
        policy.insert(key)
    book.apply(ns, ks[1:2], Retention(Priority.HIGH))  # protected after its insertion
    assert [policy.evict(lambda _: True) for _ in range(4)] == ks[2:]  # LRU order
    assert policy.evict(lambda _: True) == ks[1]  # only HIGH and the pin left
    assert policy.evict(lambda _: True) is None
    clock[0] = 11.0  # the pin lapsed: an ordinary victim again
    assert policy.evict(lambda _: True) == ks[0]
    assert len(policy) == 0
