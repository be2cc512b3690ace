"""Rebuilding the SSD engine's state on open: a scan of the self-describing records.

Every segment starts with a header (its number and the sequence number it started at); every
record carries a strictly increasing sequence number. A segment's valid records are the run
from its start up to the first block that is not a valid header, is older than the previous
record (stale bytes from the segment's previous life) or would overrun the segment. At the end
of the newest segment, a trailing run of records whose payload fails its checksum is a write
torn by a crash: it is cut, and the cut is persisted by zeroing the first torn header.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvpool.errors import CorruptRecordError
from kvpool.record import (
    BLOCK,
    HEADER_BLOCK,
    RecordHeader,
    payload_checksum,
    record_size,
    round_up,
    unpack_header,
)
from kvpool.ssd.directio import aligned_buffer
from kvpool.ssd.segments import SegmentStore, unpack_segment_header

log = logging.getLogger("kvpool.ssd")

TAIL_VERIFY_BYTES = 64 << 20  # payloads re-verified at the end of the newest segment on open


@dataclass(frozen=True, slots=True)
class FoundRecord:
    seq: int
    segment: int
    offset: int
    header: RecordHeader


@dataclass
class ScannedSegment:
    start_seq: int
    end: int  # first byte after the segment's valid records


@dataclass
class Scan:
    """What the media holds: per segment its scan (None = free), records in seq order."""

    segments: list[ScannedSegment | None]
    records: list[FoundRecord] = field(default_factory=list)
    torn_discarded: int = 0

    @property
    def max_seq(self) -> int:
        seqs = [s.start_seq for s in self.segments if s is not None]
        seqs += [r.seq for r in self.records]
        return max(seqs, default=0)


def _read(store: SegmentStore, segment: int, offset: int, out: memoryview) -> int:
    return os.preadv(store.fd(segment), [out], store.base(segment) + offset)


def scan_media(store: SegmentStore, threads: int = 4) -> Scan:
    """Read every segment header and record header (IO errors read as the end of a segment).
    Segments are independent, so ``threads`` of them are walked at once: each walk is a chain
    of dependent 4 KiB reads (a header gives the next record's offset), which alone would keep
    the device at queue depth 1. Writes only to persist a torn-tail cut."""
    result = Scan(segments=[None] * store.count)
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="kvpool-ssd-scan") as pool:
        walks = list(pool.map(lambda seg_no: _walk(store, seg_no), range(store.count)))
    found: list[FoundRecord] = []
    newest = -1
    for seg_no, walk in enumerate(walks):
        if walk is None:
            continue
        scanned, records = walk
        result.segments[seg_no] = scanned
        found += records
        newest_seg = result.segments[newest] if newest >= 0 else None
        if newest_seg is None or scanned.start_seq > newest_seg.start_seq:
            newest = seg_no
    if newest >= 0:
        result.torn_discarded = _discard_torn_tail(store, newest, result, found)
    result.records = sorted(found, key=lambda r: r.seq)
    return result


def _walk(store: SegmentStore, seg_no: int) -> tuple[ScannedSegment, list[FoundRecord]] | None:
    """One segment's header and records; None for a free (or unreadable, or foreign) one."""
    block = memoryview(aligned_buffer(BLOCK))
    try:
        _read(store, seg_no, 0, block)
    except OSError:
        return None
    sh = unpack_segment_header(block)
    if sh is None or sh.segment_size != store.segment_size or sh.number != seg_no:
        return None
    records: list[FoundRecord] = []
    end = _scan_segment(store, seg_no, sh.start_seq, block, records)
    return ScannedSegment(sh.start_seq, end), records


def _scan_segment(store: SegmentStore, seg_no: int, start_seq: int, block: memoryview,
                  found: list[FoundRecord]) -> int:
    offset, prev_seq = HEADER_BLOCK, start_seq
    while offset + HEADER_BLOCK <= store.segment_size:
        try:
            if _read(store, seg_no, offset, block) < HEADER_BLOCK:
                break
            h = unpack_header(block)
        except (OSError, CorruptRecordError):
            break
        size = record_size(h.payload_len)
        if h.seq <= prev_seq or offset + size > store.segment_size:
            break
        found.append(FoundRecord(h.seq, seg_no, offset, h))
        prev_seq, offset = h.seq, offset + size
    return offset


def _discard_torn_tail(store: SegmentStore, seg_no: int, result: Scan,
                       found: list[FoundRecord]) -> int:
    """Cut the trailing run of bad-payload records of the newest segment. A bad record
    followed by a good one is not a tear (writes are ordered): it stays, its reads become
    counted misses, and the acknowledged records after it survive. Returns records cut."""
    scanned = result.segments[seg_no]
    assert scanned is not None
    mine = sorted((r for r in found if r.segment == seg_no), key=lambda r: r.seq)
    tail_start = scanned.end - TAIL_VERIFY_BYTES
    torn: list[FoundRecord] = []
    for record in reversed(mine):
        if (record.offset < tail_start or record.header.is_tombstone
                or _payload_ok(store, record)):
            break
        torn.append(record)
    if not torn:
        return 0
    cut = {r.seq for r in torn}
    found[:] = [r for r in found if r.seq not in cut]
    first_torn = torn[-1].offset
    # Persist the cut: a zeroed header ends every later scan here, so the torn records do
    # not come back once this segment is no longer the newest.
    os.pwritev(store.fd(seg_no), [memoryview(aligned_buffer(BLOCK))],
               store.base(seg_no) + first_torn)
    store.sync(seg_no)
    scanned.end = first_torn
    log.warning("ssd: discarded %d torn record(s) at the log tail", len(torn))
    return len(torn)


def _payload_ok(store: SegmentStore, record: FoundRecord) -> bool:
    h = record.header
    buf = memoryview(aligned_buffer(round_up(h.payload_len)))
    try:
        n = _read(store, record.segment, record.offset + HEADER_BLOCK, buf)
    except OSError:
        return False
    return n >= h.payload_len and payload_checksum(buf[:h.payload_len]) == h.checksum
