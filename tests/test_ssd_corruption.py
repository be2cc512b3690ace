"""Media corruption under the SSD engine: bit flips, torn tails, garbage segment files.

The contract (engine.py): a read never returns bytes that fail a checksum; such a read is a
counted miss (``checksum_failures``), never an exception, and other records are unaffected.
Records are located on disk by scanning the segment files for their header, so the tests do
not depend on which segment the engine picks first.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvpool import KVLayout, KVPool, Namespace
from kvpool.config import config_from_dict
from kvpool.errors import CorruptRecordError
from kvpool.record import BLOCK, HEADER_BLOCK, RecordHeader, record_size, unpack_header
from kvpool.ssd.engine import SsdEngine
from kvpool.ssd.segments import SegmentHeader

MiB = 1 << 20
NS = Namespace("m", KVLayout("uint8", 1, 1, 65536, 1, kv_factor=1))
CHUNK = NS.chunk_bytes  # 64 KiB: 14 records to a 1 MiB segment (the 15th would eat the room
SEG = MiB                # kept at its end for the segment's summary)
PER_SEG = 14
CAP = 4 * MiB


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") + b"corruptn"


def data(i: int, size: int = CHUNK) -> np.ndarray:
    return np.random.default_rng(1000 + i).integers(0, 256, size, dtype=np.uint8)


def engine_at(path: Path, durability: str = "durable") -> SsdEngine:
    return SsdEngine(path, CAP, SEG, durability)  # type: ignore[arg-type]


def read(engine: SsdEngine, i: int, size: int = CHUNK) -> np.ndarray | None:
    out = np.zeros(size, dtype=np.uint8)
    return out if engine.get_into(key(i), out) else None


def assert_exact(engine: SsdEngine, indices: list[int] | range) -> None:
    for i in indices:
        got = read(engine, i)
        assert got is not None, f"record {i} is missing"
        assert np.array_equal(got, data(i)), f"record {i} has wrong bytes"


def locate(path: Path, k: bytes) -> tuple[Path, int, RecordHeader]:
    """(segment file, byte offset of the header block, header) of the one record of ``k``."""
    found = []
    for seg in sorted(path.glob("seg-*.kvs")):
        raw = seg.read_bytes()
        for off in range(HEADER_BLOCK, len(raw), BLOCK):
            if raw[off:off + 4] != b"KVPR":
                continue
            try:
                h = unpack_header(raw, off)
            except CorruptRecordError:
                continue
            if h.key == k:
                found.append((seg, off, h))
    assert len(found) == 1, f"expected exactly one record of {k.hex()}, found {len(found)}"
    return found[0]


def flip_bit(file: Path, offset: int, bit: int = 3) -> None:
    fd = os.open(file, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ (1 << bit)]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def overwrite(file: Path, offset: int, payload: bytes) -> None:
    fd = os.open(file, os.O_RDWR)
    try:
        os.pwrite(fd, payload, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def fill(engine: SsdEngine, indices: range) -> None:
    for i in indices:
        assert engine.put(key(i), NS, data(i))


# ---------------------------------------------------------------------------- live bit flips
@pytest.mark.parametrize("where", [0, 1000, CHUNK // 2, CHUNK - 1])
def test_payload_bit_flip_is_a_counted_miss(tmp_path: Path, where: int) -> None:
    e = engine_at(tmp_path)
    try:
        fill(e, range(10))
        seg, off, _ = locate(tmp_path, key(4))
        flip_bit(seg, off + HEADER_BLOCK + where)
        assert read(e, 4) is None
        st = e.stats()
        assert st["checksum_failures"] == 1
        assert st["misses"] == 1 and st["hits"] == 0
        # the bad record is dropped from the index: the next read is a plain miss
        assert not e.contains(key(4))
        assert read(e, 4) is None
        assert e.stats()["checksum_failures"] == 1
        assert_exact(e, [i for i in range(10) if i != 4])
        assert e.stats()["checksum_failures"] == 1
        assert len(e) == 9
        # the key can be written again and reads back
        assert e.put(key(4), NS, data(4))
        assert_exact(e, range(10))
    finally:
        e.close()


# magic, version, flags, key, namespace id, layout id, length, seq, payload checksum,
# reserved, header checksum: every byte of the 128-byte header is covered
@pytest.mark.parametrize("where", [0, 4, 6, 8, 30, 40, 48, 56, 64, 100, 120, 127])
def test_header_bit_flip_is_a_counted_miss(tmp_path: Path, where: int) -> None:
    e = engine_at(tmp_path)
    try:
        fill(e, range(10))
        seg, off, _ = locate(tmp_path, key(6))
        flip_bit(seg, off + where)
        assert read(e, 6) is None
        assert e.stats()["checksum_failures"] == 1
        assert not e.contains(key(6))
        assert_exact(e, [i for i in range(10) if i != 6])
        assert e.stats()["checksum_failures"] == 1
    finally:
        e.close()


def test_header_block_padding_is_not_part_of_the_record(tmp_path: Path) -> None:
    """Only the first 128 bytes of a header block are the header; the rest is zero padding and
    carries nothing, so damage there costs nothing."""
    e = engine_at(tmp_path)
    try:
        fill(e, range(3))
        seg, off, _ = locate(tmp_path, key(1))
        flip_bit(seg, off + 2000)
        assert_exact(e, range(3))
        assert e.stats()["checksum_failures"] == 0
    finally:
        e.close()


def test_bit_flip_through_kvpool(tmp_path: Path) -> None:
    cfg = config_from_dict({
        "cache_dir": str(tmp_path),
        "dram": {"capacity": 0},  # every read goes to the SSD
        "ssd": {"capacity": CAP, "segment_size": SEG, "durability": "durable"},
    })
    ssd_dir = cfg.ssd_path()
    with KVPool(cfg) as pool:
        pool.register_namespace(NS)
        for i in range(6):
            assert pool.put(NS, key(i), data(i))
        assert pool.flush(timeout=30)
        seg, off, _ = locate(ssd_dir, key(2))
        flip_bit(seg, off + HEADER_BLOCK + 12345)
        seg, off, _ = locate(ssd_dir, key(3))
        flip_bit(seg, off + 60)  # header: the stored sequence number
        out = np.zeros(CHUNK, dtype=np.uint8)
        assert pool.get_into(NS, key(2), out) is False
        assert pool.get_into(NS, key(3), out) is False
        st = pool.stats()
        assert st["ssd"]["checksum_failures"] == 2
        assert st["pool"]["misses"] == 2 and st["pool"]["ssd_hits"] == 0
        for i in (0, 1, 4, 5):
            assert pool.get_into(NS, key(i), out) is True
            assert np.array_equal(out, data(i))
        # a fresh put of the damaged keys works and reads back
        for i in (2, 3):
            assert pool.put(NS, key(i), data(i))
        assert pool.flush(timeout=30)
        for i in (2, 3):
            out = np.zeros(CHUNK, dtype=np.uint8)
            assert pool.get_into(NS, key(i), out) is True
            assert np.array_equal(out, data(i))
        assert pool.stats()["ssd"]["checksum_failures"] == 2


# ---------------------------------------------------------------------------- after reopen
def test_payload_flip_in_sealed_segment_survives_reopen_as_a_miss(tmp_path: Path) -> None:
    e = engine_at(tmp_path)
    fill(e, range(40))  # 14 records per segment: three segments, the last one partly full
    e.close()
    seg, off, _ = locate(tmp_path, key(7))  # the middle of the oldest segment
    flip_bit(seg, off + HEADER_BLOCK + 100)
    e = engine_at(tmp_path)
    try:
        assert e.stats()["torn_discarded"] == 0
        assert len(e) == 40  # payloads of sealed segments are verified on read, not on open
        assert read(e, 7) is None
        assert e.stats()["checksum_failures"] == 1
        assert_exact(e, [i for i in range(40) if i != 7])
    finally:
        e.close()


def test_payload_flip_in_newest_segment_keeps_later_acknowledged_records(tmp_path: Path) -> None:
    """A bit flip in one record's payload must not lose the *other* records. Regression: the
    torn-tail check of the newest segment used to cut the log at the first bad payload,
    dropping every later record although they verify and (durable) were acknowledged after
    fdatasync. Only a trailing run of bad records is a tear."""
    e = engine_at(tmp_path, "durable")
    fill(e, range(10))  # one segment
    e.close()
    seg, off, _ = locate(tmp_path, key(3))
    flip_bit(seg, off + HEADER_BLOCK + 100)
    e = engine_at(tmp_path, "durable")
    try:
        assert read(e, 3) is None
        assert_exact(e, [0, 1, 2])
        assert_exact(e, range(4, 10))
    finally:
        e.close()


def test_header_flip_after_reopen_never_returns_wrong_bytes(tmp_path: Path) -> None:
    e = engine_at(tmp_path)
    fill(e, range(40))  # three segments: 0-13, 14-27, 28-39
    e.close()
    seg, off, _ = locate(tmp_path, key(20))
    flip_bit(seg, off + 30)
    e = engine_at(tmp_path)
    try:
        assert read(e, 20) is None
        # Only the damaged record is lost (tests/test_ssd_resync.py covers the walk).
        assert_exact(e, [i for i in range(40) if i != 20])
        # Its sealed segment's summary lists it, so it is indexed on open and its read is a
        # counted checksum failure (a walk would not index it at all).
        assert e.stats()["checksum_failures"] == 1
        assert not e.contains(key(20))
    finally:
        e.close()


# ---------------------------------------------------------------------------- torn tail
def _tear(seg: Path, off: int, how: str) -> None:
    payload_at = off + HEADER_BLOCK
    if how == "payload_zeroed":
        overwrite(seg, payload_at, bytes(CHUNK))
    elif how == "last_block_zeroed":
        overwrite(seg, payload_at + CHUNK - BLOCK, bytes(BLOCK))
    elif how == "stale_payload":  # header landed, payload still holds an older record's bytes
        overwrite(seg, payload_at, data(999).tobytes())
    elif how == "header_zeroed":  # payload landed, header did not
        overwrite(seg, off, bytes(BLOCK))
    else:
        raise AssertionError(how)


def _reopen_with_torn_last_record(path: Path, how: str) -> SsdEngine:
    """Six records, the last one torn on disk as ``how`` says, then a fresh open."""
    e = engine_at(path)
    fill(e, range(6))
    e.close()
    seg, off, _ = locate(path, key(5))
    _tear(seg, off, how)
    return engine_at(path)


@pytest.mark.parametrize("how", ["payload_zeroed", "last_block_zeroed", "stale_payload",
                                 "header_zeroed"])
def test_torn_tail_is_discarded_on_reopen(tmp_path: Path, how: str) -> None:
    e = _reopen_with_torn_last_record(tmp_path, how)
    try:
        st = e.stats()
        assert st["torn_discarded"] == (0 if how == "header_zeroed" else 1)
        assert len(e) == 5
        assert not e.contains(key(5))
        assert read(e, 5) is None
        assert e.stats()["checksum_failures"] == 0  # discarded on open, never read
        assert_exact(e, range(5))
        # the engine goes on: rewrite the lost record and survive another restart
        assert e.put(key(5), NS, data(5))
        assert_exact(e, range(6))
    finally:
        e.close()
    e = engine_at(tmp_path)
    try:
        assert len(e) == 6
        assert_exact(e, range(6))
    finally:
        e.close()


@pytest.mark.parametrize("how", ["payload_zeroed", "stale_payload"])
def test_torn_tail_stays_discarded_after_a_later_restart(tmp_path: Path, how: str) -> None:
    """A torn record dropped on one open must not come back on the next. Regression: the cut
    was made in memory only, so once a later open had started a new segment the torn record's
    segment was no longer the newest, was not re-verified, and the record was indexed again:
    present to contains/len/lookup, yet every read failed its checksum."""
    e = _reopen_with_torn_last_record(tmp_path, how)
    try:
        assert e.stats()["torn_discarded"] == 1
        assert not e.contains(key(5))
        fill(e, range(10, 12))  # goes to a fresh segment, which becomes the newest
    finally:
        e.close()
    e = engine_at(tmp_path)
    try:
        assert not e.contains(key(5)), "a discarded torn record is indexed again"
        assert len(e) == 7
        assert read(e, 5) is None
        assert e.stats()["checksum_failures"] == 0
        assert_exact(e, [*range(5), 10, 11])
    finally:
        e.close()


def test_truncated_segment_file_opens_and_never_returns_wrong_bytes(tmp_path: Path) -> None:
    """A segment file cut short (not something the engine's own writes can produce: files are
    preallocated) is extended back to full size: the records before the cut are kept, the one
    it cut through is a torn tail, and no wrong bytes are served; the other segments are
    intact."""
    e = engine_at(tmp_path)
    fill(e, range(20))  # segments of 0-13 and 14-19
    e.close()
    seg, off, h = locate(tmp_path, key(19))
    first, _, _ = locate(tmp_path, key(0))
    assert seg != first
    os.truncate(seg, off + HEADER_BLOCK + CHUNK // 2)
    e = engine_at(tmp_path)
    try:
        assert seg.stat().st_size == SEG
        assert read(e, 19) is None
        assert_exact(e, range(19))
        assert e.stats()["torn_discarded"] == 1
        fill(e, range(100, 130))
        assert_exact(e, range(100, 130))
    finally:
        e.close()
    assert sorted(p.stat().st_size for p in tmp_path.glob("seg-*.kvs")) == [SEG] * 4
    assert record_size(h.payload_len) == HEADER_BLOCK + CHUNK


# ---------------------------------------------------------------------------- garbage files
def _segment_files(path: Path) -> list[Path]:
    files = sorted(path.glob("seg-*.kvs"))
    assert [f.name for f in files] == [f"seg-{i:05d}.kvs" for i in range(CAP // SEG)]
    return files


def test_garbage_in_an_unused_segment_file(tmp_path: Path) -> None:
    e = engine_at(tmp_path)
    fill(e, range(20))  # two segments in use
    e.close()
    used = {locate(tmp_path, key(0))[0], locate(tmp_path, key(19))[0]}
    spare = next(f for f in _segment_files(tmp_path) if f not in used)
    spare.write_bytes(np.random.default_rng(5).bytes(SEG))
    e = engine_at(tmp_path)
    try:
        st = e.stats()
        assert st["free_segments"] == 2 and st["records"] == 20
        assert_exact(e, range(20))
        fill(e, range(20, 80))  # wraps the log through the former garbage segment
        st = e.stats()
        assert st["segments_evicted"] > 0 and st["checksum_failures"] == 0
        assert_exact(e, range(60, 80))
    finally:
        e.close()


def test_garbage_over_a_used_segment_file(tmp_path: Path) -> None:
    e = engine_at(tmp_path)
    fill(e, range(20))  # segments of 0-13 and 14-19
    e.close()
    victim, _, _ = locate(tmp_path, key(0))
    victim.write_bytes(np.random.default_rng(6).bytes(SEG))
    e = engine_at(tmp_path)
    try:
        st = e.stats()
        assert st["free_segments"] == 3 and st["records"] == 20 - PER_SEG
        for i in range(PER_SEG):
            assert not e.contains(key(i))
            assert read(e, i) is None
        assert_exact(e, range(PER_SEG, 20))
        fill(e, range(100, 160))
        assert_exact(e, range(145, 160))
        assert e.stats()["checksum_failures"] == 0
    finally:
        e.close()


@pytest.mark.parametrize("kind", ["short_random", "valid_header_random_records",
                                  "foreign_number"])
def test_odd_segment_files_are_treated_as_free(tmp_path: Path, kind: str) -> None:
    e = engine_at(tmp_path)
    fill(e, range(20))
    e.close()
    first, _, _ = locate(tmp_path, key(0))  # records 0-13
    other, _, _ = locate(tmp_path, key(19))  # records 14-19
    files = _segment_files(tmp_path)
    spare = next(f for f in files if f not in (first, other))
    number = files.index(spare)
    rng = np.random.default_rng(7)
    if kind == "short_random":
        spare.write_bytes(rng.bytes(SEG // 2))
    elif kind == "valid_header_random_records":
        blob = bytearray(rng.bytes(SEG))
        header = SegmentHeader(SEG, number, 1 << 50).pack()  # newer than anything written
        blob[:BLOCK] = bytes(header)
        spare.write_bytes(bytes(blob))
    else:  # a copy of another segment file: its header names a different segment number
        spare.write_bytes(first.read_bytes())
    e = engine_at(tmp_path)
    try:
        assert spare.stat().st_size == SEG
        st = e.stats()
        assert st["records"] == 20
        assert st["free_segments"] == (1 if kind == "valid_header_random_records" else 2)
        assert_exact(e, range(20))
        fill(e, range(100, 180))  # wraps the log: every segment is rewritten
        assert_exact(e, range(165, 180))
        assert e.stats()["checksum_failures"] == 0
    finally:
        e.close()
    e = engine_at(tmp_path)
    try:
        assert_exact(e, range(165, 180))
    finally:
        e.close()
