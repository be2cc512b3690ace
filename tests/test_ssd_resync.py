"""Recovery that keeps every undamaged record: per-segment summaries, the resynchronising
header walk, repaired segment files, stale bytes of a segment's previous life.

Geometry as in test_ssd_corruption.py: 1 MiB segments, 4 MiB capacity, 64 KiB records, 14 to
a segment; 40 records fill segments with 0-13 and 14-27 (sealed, with summaries) and leave
28-39 in the active one (no summary: a close does not seal it, exactly like a crash).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
from kvtest import read_acks
from test_ssd_corruption import NS, SEG, flip_bit, locate, overwrite
from test_ssd_crash import MiB, _check_reads, _run_and_kill, cw

from kvpool.keys import KVLayout, Namespace
from kvpool.record import BLOCK, HEADER_BLOCK, record_size
from kvpool.ssd import summary
from kvpool.ssd.engine import SsdEngine
from kvpool.ssd.segments import SegmentStore, unpack_segment_header

CAP = 4 * SEG
CHUNK = NS.chunk_bytes
N = 40


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") + b"resyncdd"


def data(i: int, size: int = CHUNK) -> np.ndarray:
    return np.random.default_rng(5000 + i).integers(0, 256, size, dtype=np.uint8)


def engine_at(path: Path, **kw: object) -> SsdEngine:
    return SsdEngine(path, CAP, SEG, "durable", **kw)  # type: ignore[arg-type]


def written(path: Path, indices: range, size: int = CHUNK, **kw: object) -> None:
    e = engine_at(path, **kw)
    try:
        for i in indices:
            assert e.put(key(i), NS, data(i, size))
    finally:
        e.close()


def hits(e: SsdEngine, indices: range | list[int], size: int = CHUNK) -> list[int]:
    """Indices that read back; every one of them byte-exact."""
    got = []
    for i in indices:
        out = np.zeros(size, dtype=np.uint8)
        if e.get_into(key(i), out):
            assert np.array_equal(out, data(i, size)), f"record {i} has wrong bytes"
            got.append(i)
    return got


def summary_of(path: Path, seg_file: Path) -> summary.Summary | None:
    """The segment's summary as an open would read it (engine closed)."""
    number = int(seg_file.stem.split("-")[1])
    store = SegmentStore(path, CAP, SEG, "off")
    try:
        head = memoryview(bytearray(os.pread(store.fd(number), BLOCK, 0)))
        sh = unpack_segment_header(head)
        assert sh is not None
        return summary.read(store, number, sh.start_seq)
    finally:
        store.close()


def damage_summary(seg_file: Path, how: str) -> None:
    last = SEG - BLOCK
    if how == "entries":  # the first entry's key: the body checksum fails
        flip_bit(seg_file, last + 3)
    elif how == "footer":  # the footer's start seq: the footer checksum fails
        flip_bit(seg_file, SEG - 20)
    elif how == "zeroed":
        overwrite(seg_file, last, bytes(BLOCK))
    else:
        raise AssertionError(how)


# ---------------------------------------------------------------------------- one bad header
@pytest.mark.parametrize("where", [0, 30, 60, 127])  # magic, key, seq, header checksum
@pytest.mark.parametrize("with_summary", [True, False])
def test_header_flip_in_a_sealed_segment_loses_exactly_that_record(
        tmp_path: Path, where: int, with_summary: bool) -> None:
    written(tmp_path, range(N))
    seg, off, _ = locate(tmp_path, key(20))  # the middle of the sealed segment of 14-27
    assert summary_of(tmp_path, seg) is not None
    flip_bit(seg, off + where)
    if not with_summary:
        damage_summary(seg, "entries")  # the open must walk it, resynchronising after 20
    e = engine_at(tmp_path)
    try:
        assert hits(e, range(N)) == [i for i in range(N) if i != 20]
        st = e.stats()
        # listed by the summary, the record is indexed and its read is a counted failure; a
        # walk never indexes a header it cannot parse
        assert st["checksum_failures"] == (1 if with_summary else 0)
        assert len(e) == N - 1 and st["torn_discarded"] == 0
    finally:
        e.close()
    e = engine_at(tmp_path)  # and the next open agrees (the walk wrote a new summary)
    try:
        assert hits(e, range(N)) == [i for i in range(N) if i != 20]
    finally:
        e.close()
    assert summary_of(tmp_path, seg) is not None


@pytest.mark.parametrize("victim", [28, 33, 38])  # first, middle, next to last of the active
def test_header_flip_in_the_active_segment_loses_exactly_that_record(
        tmp_path: Path, victim: int) -> None:
    written(tmp_path, range(N))
    seg, off, _ = locate(tmp_path, key(victim))
    assert locate(tmp_path, key(N - 1))[0] == seg
    assert summary_of(tmp_path, seg) is None  # the active segment has none: it is walked
    flip_bit(seg, off + 60)
    e = engine_at(tmp_path)
    try:
        assert len(e) == N - 1
        assert hits(e, range(N)) == [i for i in range(N) if i != victim]
        assert e.stats()["checksum_failures"] == 0
        assert e.put(key(victim), NS, data(victim))  # the engine goes on
    finally:
        e.close()
    e = engine_at(tmp_path)
    try:
        assert hits(e, range(N)) == list(range(N))
    finally:
        e.close()


# ---------------------------------------------------------------------------- summaries
@pytest.mark.parametrize("how", ["entries", "footer", "zeroed"])
def test_damaged_summary_falls_back_to_the_walk_and_loses_nothing(
        tmp_path: Path, how: str) -> None:
    written(tmp_path, range(N))
    seg, _, _ = locate(tmp_path, key(5))
    damage_summary(seg, how)
    assert summary_of(tmp_path, seg) is None
    e = engine_at(tmp_path)
    try:
        assert len(e) == N
        assert hits(e, range(N)) == list(range(N))
        assert e.stats()["checksum_failures"] == 0
    finally:
        e.close()
    found = summary_of(tmp_path, seg)  # rewritten from the walk
    assert found is not None
    assert sorted(found.entries["key"].tolist()) == sorted(key(i) for i in range(14))


def test_summary_replays_tombstones_exactly_like_the_walk(tmp_path: Path) -> None:
    """Deletes, a namespace invalidation and rewrites spread over sealed segments: an open
    from the summaries and an open from a walk of every segment index the same records."""
    other = Namespace("other", KVLayout("uint8", 1, 1, 65536, 1, kv_factor=1))
    e = engine_at(tmp_path)
    try:
        for i in range(20):
            assert e.put(key(i), other if i % 3 == 0 else NS, data(i))
        for i in (1, 4, 7):
            assert e.delete(key(i))
        assert e.invalidate(other.id) == 7  # 0, 3, ..., 18
        for i in (3, 4, 21, 22):  # a key of the invalidated namespace and a deleted key back
            assert e.put(key(i), NS, data(i))
        for i in range(30, 50):
            assert e.put(key(i), NS, data(i))
        expected = [i for i in range(60) if e.contains(key(i))]
    finally:
        e.close()
    assert expected == [2, 3, 4, 5, 8, 10, 11, 13, 14, 16, 17, 19, 21, 22, *range(30, 50)]

    def reopened() -> list[int]:
        e = engine_at(tmp_path)
        try:
            assert [i for i in range(60) if e.contains(key(i))] == expected
            assert hits(e, range(60)) == expected
            return expected
        finally:
            e.close()

    reopened()  # the active segment is walked and given a summary
    files = sorted(tmp_path.glob("seg-*.kvs"))
    assert all(summary_of(tmp_path, f) is not None for f in files)
    reopened()  # every segment from its summary
    for f in files:
        damage_summary(f, "zeroed")
    reopened()  # every segment walked


# ---------------------------------------------------------------------------- ranges
@pytest.mark.parametrize("where", ["sealed_with_summary", "sealed_walked", "active"])
def test_damaged_block_range_loses_only_the_records_overlapping_it(
        tmp_path: Path, where: int) -> None:
    written(tmp_path, range(N))
    first = 14 if where != "active" else 28
    where_is = {i: locate(tmp_path, key(i)) for i in range(N)}
    seg, start, _ = where_is[first + 3]
    # from the middle of record first+3's payload to the middle of first+6's
    lo = start + HEADER_BLOCK + CHUNK // 2
    hi = where_is[first + 6][1] + HEADER_BLOCK + CHUNK // 2
    overwrite(seg, lo, np.random.default_rng(9).bytes(hi - lo))
    if where == "sealed_walked":
        damage_summary(seg, "entries")
    lost = [i for i, (f, off, h) in where_is.items()
            if f == seg and off < hi and off + record_size(h.payload_len) > lo]
    assert lost == [first + 3, first + 4, first + 5, first + 6]
    e = engine_at(tmp_path)
    try:
        assert hits(e, range(N)) == [i for i in range(N) if i not in lost]
    finally:
        e.close()


# ---------------------------------------------------------------------------- stale bytes
def test_stale_headers_of_a_previous_life_are_never_resurrected(tmp_path: Path) -> None:
    """Old life: every segment full of small records (a header every 8 KiB). New life: the
    log wrapped with 64 KiB records, the last segment only just started, so its tail still
    holds the old life's headers and the old life's summary. With a header of the new life
    damaged, the walk steps over it and on through those stale bytes: none may come back."""
    small = 4096
    per_seg = max(n for n in range(1, SEG // (2 * BLOCK))
                  if BLOCK + n * 2 * BLOCK + summary.room(n, 1) <= SEG)
    old = 4 * per_seg
    e = engine_at(tmp_path, eviction="fifo")
    try:
        for j in range(old):
            assert e.put(key(10_000 + j), NS, data(10_000 + j, small))
        st = e.stats()
        assert st["free_segments"] == st["segments_evicted"] == 0 and len(e) == old
        # the log is exactly full of the old life now; wrap it with new records
        new = range(3 * 14 + 3)  # three full segments and 3 records in the fourth
        for i in new:
            assert e.put(key(i), NS, data(i))
        assert e.stats()["segments_evicted"] == 4
        assert not any(e.contains(key(10_000 + j)) for j in range(old))
    finally:
        e.close()
    seg, off, _ = locate(tmp_path, key(43))
    assert locate(tmp_path, key(42))[0] == seg and locate(tmp_path, key(44))[0] == seg
    # stale old-life headers are still on the media beyond the new records
    raw = seg.read_bytes()
    stale = sum(raw[o:o + 4] == b"KVPR" for o in range(off + 3 * (HEADER_BLOCK + CHUNK),
                                                       SEG, BLOCK))
    assert stale > 50
    flip_bit(seg, off + 60)
    for _ in range(2):  # the walk, then the summary it wrote
        e = engine_at(tmp_path, eviction="fifo")
        try:
            assert len(e) == len(new) - 1
            assert not any(e.contains(key(10_000 + j)) for j in range(old))
            assert hits(e, [10_000 + j for j in range(old)], small) == []
            assert hits(e, new) == [i for i in new if i != 43]
        finally:
            e.close()


# ---------------------------------------------------------------------------- files
@pytest.mark.parametrize("junk", [1, 4095, 4096, SEG])
def test_segment_file_with_trailing_junk_is_repaired_and_keeps_its_records(
        tmp_path: Path, junk: int) -> None:
    written(tmp_path, range(20))  # a sealed segment (0-13) and the active one (14-19)
    used = [locate(tmp_path, key(i))[0] for i in (0, 19)]
    for seg in used:
        with seg.open("ab") as f:
            f.write(np.random.default_rng(junk).bytes(junk))
    spare = next(f for f in sorted(tmp_path.glob("seg-*.kvs")) if f not in used)
    spare.write_bytes(b"x" * 100)  # too short for a header: re-created
    (tmp_path / "seg-00009.kvs").write_bytes(bytes(SEG))  # beyond the capacity: removed
    e = engine_at(tmp_path)
    try:
        assert len(e) == 20
        assert hits(e, range(20)) == list(range(20))
        assert e.stats()["checksum_failures"] == 0
    finally:
        e.close()
    assert sorted(p.name for p in tmp_path.glob("seg-*.kvs")) == \
        [f"seg-{i:05d}.kvs" for i in range(4)]
    assert all(p.stat().st_size == SEG for p in tmp_path.glob("seg-*.kvs"))


# ---------------------------------------------------------------------------- crashes
def test_sigkill_then_header_damage_keeps_every_other_acknowledged_record(
        tmp_path: Path) -> None:
    """A child writes durably until SIGKILLed (tests/crash_writer.py); after each kill one
    acknowledged record's header is damaged. The reopen returns no torn or wrong bytes, loses
    exactly the damaged records, and keeps every other acknowledged one."""
    directory, ack, log = tmp_path / "ssd", tmp_path / "acks.log", tmp_path / "child.log"
    capacity, seg_size, max_payload = 32 * MiB, MiB, 16384
    salt = "resync-crash"
    rng = random.Random(5)
    damaged: set[bytes] = set()
    for _cycle in range(6):
        start = len(read_acks(ack))
        _run_and_kill(directory, ack, durability="durable", capacity=capacity,
                      segment_size=seg_size, eviction="fifo", start=start, salt=salt,
                      max_payload=max_payload, delay=rng.uniform(0.1, 0.4), reads=False,
                      deletes=False, pause=0.002, log=log)
        acked = read_acks(ack)
        assert len(acked) > start
        victim = rng.choice([k for k in acked if k not in damaged])
        seg, off, _ = locate(directory, victim)
        flip_bit(seg, off + 40)  # the layout id: the header checksum fails
        damaged.add(victim)
        candidates = [cw.key_of(salt, i) for i in range(len(acked) + cw.MAX_BATCH)]
        engine = SsdEngine(directory, capacity, seg_size, "durable", eviction="fifo")
        try:
            got = _check_reads(engine, candidates, max_payload)  # byte-exact or a miss
            assert engine.stats()["free_segments"] > 0  # nothing was evicted
            missing = [k.hex() for k in acked if k not in got and k not in damaged]
            assert not missing, f"{len(missing)} acknowledged records lost"
            assert not damaged & got
        finally:
            engine.close()
