"""The DRAM tier's read directory (tiers/directory.py): what a reader finds, what it must not
use, and that the tier keeps it equal to what it holds through every way a chunk leaves."""

from __future__ import annotations

import errno
import math
import mmap
import os
import time
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtest import CHUNK, byte_namespace, payload_for

from kvpool.config import config_from_dict
from kvpool.errors import ConfigError
from kvpool.keys import Namespace
from kvpool.retention import Retention, RetentionBook
from kvpool.tiers.directory import (
    MIN_ENTRIES,
    WAYS,
    DirectoryReader,
    ReadDirectory,
    _bucket,
    _shift,
    entries_for,
)
from kvpool.tiers.dram import DramTier

SLAB = 4 * CHUNK  # four 64 KiB slots per slab
ARENA = 1 << 30
NS = bytes(range(16))
Pair = tuple[ReadDirectory, DirectoryReader]


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") * 2


@pytest.fixture
def pair() -> Iterator[tuple[ReadDirectory, DirectoryReader]]:
    writer = ReadDirectory(1024)
    reader = DirectoryReader(writer.fd, writer.nbytes)
    yield writer, reader
    writer.close()


def found(reader: DirectoryReader, keys: list[bytes], ns: bytes = NS,
          nbytes: int = CHUNK, arena: int = ARENA) -> dict[bytes, int]:
    at, offsets, entries, seqs = reader.find(keys, ns, nbytes, arena)
    assert reader.changed(entries, seqs) == []
    return {keys[i]: off for i, off in zip(at, offsets, strict=True)}


def test_a_published_chunk_is_found_with_its_slot_and_a_withdrawn_one_is_not(pair: Pair) -> None:
    writer, reader = pair
    keys = [key(i) for i in range(20)]
    for i, k in enumerate(keys[:10]):
        assert writer.publish(k, NS, i * CHUNK, CHUNK)
    assert found(reader, keys) == {k: i * CHUNK for i, k in enumerate(keys[:10])}
    writer.withdraw(keys[3])
    writer.withdraw(key(999))  # unknown: ignored
    assert keys[3] not in found(reader, keys) and len(found(reader, keys)) == 9
    assert len(writer) == 9


def test_what_a_reader_must_not_use_is_not_found(pair: Pair) -> None:
    """Another namespace, another chunk size, a slot past the arena's end, a passed TTL."""
    writer, reader = pair
    writer.publish(key(1), NS, 0, CHUNK)
    writer.publish(key(2), NS, ARENA - CHUNK // 2, CHUNK)  # would read past the arena
    writer.publish(key(3), NS, CHUNK, CHUNK, expires=time.time() - 1)
    writer.publish(key(4), NS, 2 * CHUNK, CHUNK, expires=time.time() + 3600)
    keys = [key(i) for i in range(1, 5)]
    assert found(reader, keys) == {key(1): 0, key(4): 2 * CHUNK}
    assert found(reader, keys, ns=bytes(16)) == {}
    assert found(reader, keys, nbytes=2 * CHUNK) == {}
    assert found(reader, keys, arena=CHUNK // 2) == {}  # a chunk larger than the arena
    assert found(reader, []) == {}


def test_a_copy_made_while_the_slot_changed_hands_is_refused(pair: Pair) -> None:
    """The seqlock, step by step: the reader finds key 1 in slot 0; the tier withdraws it
    and gives slot 0 to key 2; the reader's copy (whatever it got) is refused, while a copy
    of key 2 found after the change is accepted. A withdraw and republish of the same key
    (a TTL change) also moves the sequence."""
    writer, reader = pair
    writer.publish(key(1), NS, 0, CHUNK)
    at, offsets, entries, seqs = reader.find([key(1)], NS, CHUNK, ARENA)
    assert at == [0] and offsets == [0] and reader.changed(entries, seqs) == []
    writer.withdraw(key(1))
    writer.publish(key(2), NS, 0, CHUNK)
    assert reader.changed(entries, seqs) == [0]
    at2, _, entries2, seqs2 = reader.find([key(1), key(2)], NS, CHUNK, ARENA)
    assert at2 == [1] and reader.changed(entries2, seqs2) == []
    writer.expiry(key(2), time.time() + 60)
    assert reader.changed(entries2, seqs2) == [0]
    assert found(reader, [key(2)]) == {key(2): 0}
    writer.expiry(key(2), time.time() + 60 * 60)  # later deadline: found again after it
    assert found(reader, [key(2)]) == {key(2): 0}


def test_a_full_bucket_publishes_nothing_more_and_counts_it(pair: Pair) -> None:
    writer, reader = pair
    shift = _shift(writer.entries)
    same = [k for k in (key(i) for i in range(20000)) if _bucket(k, shift) == 5][:WAYS + 2]
    assert len(same) == WAYS + 2
    published = [writer.publish(k, NS, i * CHUNK, CHUNK) for i, k in enumerate(same)]
    assert published == [True] * WAYS + [False, False]
    assert writer.full_buckets == 2
    assert set(found(reader, same)) == set(same[:WAYS])
    writer.withdraw(same[0])  # room again
    assert writer.publish(same[-1], NS, 0, CHUNK)
    assert same[-1] in found(reader, same)


def test_engines_map_it_read_only_and_a_bad_size_is_refused(pair: Pair) -> None:
    writer, _ = pair
    with pytest.raises(PermissionError):
        mmap.mmap(writer.fd, writer.nbytes, mmap.MAP_SHARED,
                  mmap.PROT_READ | mmap.PROT_WRITE)
    with pytest.raises(OSError) as failed:
        os.pwrite(writer.fd, b"x", 0)
    assert failed.value.errno == errno.EPERM
    with pytest.raises(OSError):
        os.ftruncate(writer.fd, writer.nbytes * 2)
    for nbytes in (0, 100, 64 * (MIN_ENTRIES - 1), 64 * (MIN_ENTRIES + 8)):
        with pytest.raises(ValueError):
            DirectoryReader(writer.fd, nbytes)
    with pytest.raises(ValueError):
        ReadDirectory(100)


def test_a_closed_reader_finds_nothing_and_a_closed_writer_withdrew_everything() -> None:
    writer = ReadDirectory(MIN_ENTRIES)
    reader = DirectoryReader(writer.fd, writer.nbytes)
    other = DirectoryReader(writer.fd, writer.nbytes)
    writer.publish(key(1), NS, 0, CHUNK)
    reader.close()
    assert found(reader, [key(1)]) == {}
    writer.close()
    writer.close()  # idempotent
    assert found(other, [key(1)]) == {}


def test_the_default_size() -> None:
    assert entries_for(0) == 4096
    assert entries_for(8 << 30) == 1 << 19  # two entries per 32 KiB
    assert entries_for(1 << 50) == 1 << 24
    assert math.log2(entries_for(3 << 30)).is_integer()


# ---------------------------------------------------------------- the DRAM tier keeps it


def tier_with_directory(capacity: int = 2 * SLAB,
                        retention: RetentionBook | None = None) -> tuple[DramTier,
                                                                         DirectoryReader]:
    tier = DramTier(capacity, SLAB, "lru", put_wait_s=0.05, retention=retention)
    directory = ReadDirectory(MIN_ENTRIES * 4)
    tier.share_directory(directory)
    return tier, DirectoryReader(directory.fd, directory.nbytes)


def check_same(tier: DramTier, reader: DirectoryReader, ns: Namespace,
               keys: list[bytes]) -> None:
    """The directory shows exactly the resident chunks of ``ns``, at their slots, and each
    slot it shows holds that chunk's bytes."""
    shown = found(reader, keys, ns.id, ns.chunk_bytes, tier.capacity)
    assert set(shown) == {k for k in keys if tier.contains(k, ns.id)}
    arena = tier._arena
    for k, offset in shown.items():
        view = np.frombuffer(arena.view(offset, ns.chunk_bytes), np.uint8)
        assert np.array_equal(view, payload_for(k, ns.chunk_bytes))


def test_the_tier_withdraws_a_chunk_on_eviction_delete_invalidate_steal_and_close() -> None:
    small, other = byte_namespace(CHUNK), byte_namespace(CHUNK, model="other")
    big = byte_namespace(2 * CHUNK, model="big")
    tier, reader = tier_with_directory()
    keys = [key(i) for i in range(12)]
    for k in keys[:8]:
        assert tier.put(k, small, payload_for(k))
    check_same(tier, reader, small, keys)
    for k in keys[8:]:  # evicts four (lru)
        assert tier.put(k, small, payload_for(k))
    check_same(tier, reader, small, keys)
    assert len(found(reader, keys, small.id, CHUNK, tier.capacity)) == 8
    assert tier.delete(keys[9])
    check_same(tier, reader, small, keys)
    view = tier.view(keys[10], small.id)  # deleted while pinned: withdrawn at once
    assert view is not None and tier.delete(keys[10])
    check_same(tier, reader, small, keys)
    view.release()
    tier.put(key(50), other, payload_for(key(50)))
    assert tier.invalidate(small.id) > 0
    check_same(tier, reader, small, keys)
    assert len(found(reader, [key(50)], other.id, CHUNK, tier.capacity)) == 1
    for i in range(8):  # fill both slabs with 64 KiB chunks, then steal one for 128 KiB
        tier.put(key(100 + i), small, payload_for(key(100 + i)))
    assert tier.put(key(200), big, payload_for(key(200), 2 * CHUNK))
    assert tier.stats()["slab_steals"] >= 1
    check_same(tier, reader, small, [key(100 + i) for i in range(8)])
    check_same(tier, reader, big, [key(200)])
    assert tier.stats()["directory_entries"] == len(found(
        reader, [key(100 + i) for i in range(8)], small.id, CHUNK, tier.capacity)) + 1 + len(
        found(reader, [key(50)], other.id, CHUNK, tier.capacity))
    tier.close()
    assert found(reader, [key(200)], big.id, 2 * CHUNK, 2 * SLAB) == {}


def test_sharing_a_directory_publishes_what_the_tier_already_holds() -> None:
    ns = byte_namespace(CHUNK)
    tier = DramTier(2 * SLAB, SLAB, "lru")
    keys = [key(i) for i in range(5)]
    for k in keys:
        tier.put(k, ns, payload_for(k))
    directory = ReadDirectory(MIN_ENTRIES)
    tier.share_directory(directory)
    check_same(tier, DirectoryReader(directory.fd, directory.nbytes), ns, keys)
    tier.close()


def test_a_ttl_reaches_the_directory_and_a_passed_one_is_a_miss_there() -> None:
    ns = byte_namespace(CHUNK)
    book = RetentionBook(1 << 30)
    tier, reader = tier_with_directory(retention=book)
    k1, k2 = key(1), key(2)
    book.apply(ns, [k1], Retention(expires_at=time.time() - 1))  # passed before its put
    tier.put(k1, ns, payload_for(k1))
    tier.put(k2, ns, payload_for(k2))
    assert set(found(reader, [k1, k2], ns.id)) == {k2}
    book.apply(ns, [k2], Retention(expires_at=time.time() - 1))  # recorded after the put
    tier.retention_changed([k2])
    assert found(reader, [k1, k2], ns.id) == {}
    tier.close()


def test_reads_counted_afterwards_count_as_hits_and_recency() -> None:
    """``note_reads`` (an engine's directory reads, reported late) is a hit and a touch:
    with LRU the chunks read survive the next evictions, the others go."""
    ns = byte_namespace(CHUNK)
    tier, _ = tier_with_directory(capacity=SLAB)
    keys = [key(i) for i in range(6)]
    for k in keys[:4]:
        tier.put(k, ns, payload_for(k))
    assert tier.note_reads([keys[0], keys[1], key(99)], ns.id) == 2
    assert tier.note_reads([keys[2]], bytes(16)) == 0  # another namespace: not counted
    assert tier.stats()["hits"] == 2
    for k in keys[4:]:
        tier.put(k, ns, payload_for(k))
    assert [tier.contains(k) for k in keys] == [True, True, False, False, True, True]
    tier.close()
    assert tier.note_reads(keys, ns.id) == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "delete", "pin", "unpin", "invalidate"]),
                          st.integers(0, 15)), min_size=1, max_size=80))
def test_the_directory_always_shows_exactly_what_the_tier_holds(
        ops: list[tuple[str, int]]) -> None:
    ns = byte_namespace(CHUNK)
    tier, reader = tier_with_directory()
    keys = [key(i) for i in range(16)]
    pinned = []
    try:
        for op, i in ops:
            k = keys[i]
            if op == "put":
                tier.put(k, ns, payload_for(k))
            elif op == "delete":
                tier.delete(k)
            elif op == "pin":
                view = tier.view(k, ns.id)
                if view is not None:
                    pinned.append(view)
            elif op == "unpin" and pinned:
                pinned.pop(i % len(pinned)).release()
            elif op == "invalidate" and i % 5 == 0:
                tier.invalidate(ns.id)
            check_same(tier, reader, ns, keys)
    finally:
        for view in pinned:
            view.release()
        tier.close()


def test_a_table_size_that_is_no_power_of_two_is_refused_in_the_config() -> None:
    with pytest.raises(ConfigError, match="power of two"):
        config_from_dict({"host": {"directory_entries": 100}})
    assert config_from_dict({"host": {"directory_entries": 128}}).host.directory_entries == 128


def test_a_remembered_lookup_is_used_only_while_its_entry_is_unchanged(pair: Pair) -> None:
    """A reader remembers where it found keys; once an entry moves (the chunk withdrawn,
    published elsewhere, or gone) the next find looks again, so it neither misses a chunk
    that moved nor returns one that went."""
    writer, reader = pair
    keys = [key(i) for i in range(4)]
    for i, k in enumerate(keys):
        writer.publish(k, NS, i * CHUNK, CHUNK)
    assert found(reader, keys) == {k: i * CHUNK for i, k in enumerate(keys)}
    assert found(reader, keys) == {k: i * CHUNK for i, k in enumerate(keys)}  # remembered
    writer.withdraw(keys[1])
    writer.publish(keys[1], NS, 9 * CHUNK, CHUNK)  # moved
    writer.withdraw(keys[2])  # gone
    assert found(reader, keys) == {keys[0]: 0, keys[1]: 9 * CHUNK, keys[3]: 3 * CHUNK}
    assert found(reader, [keys[0], keys[1], keys[3]]) == {
        keys[0]: 0, keys[1]: 9 * CHUNK, keys[3]: 3 * CHUNK}
    writer.expiry(keys[3], time.time() - 1)  # its TTL passed
    assert found(reader, [keys[0], keys[3]]) == {keys[0]: 0}
    assert found(reader, keys, ns=bytes(16)) == {}  # remembered per namespace
