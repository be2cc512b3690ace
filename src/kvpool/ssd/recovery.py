"""Rebuilding the SSD engine's state on open: per segment its summary, or a walk of its
self-describing records.

Every segment starts with a header (its number and the sequence number its current life
started at); every record carries a sequence number, strictly increasing along the segment.
A sealed segment normally ends with a summary (summary.py) listing its records: one or two
reads. A segment without a valid one (the active segment at a crash, a damaged summary, media
of an older kvpool) is walked: from each valid record header to the next. A block that is not
a valid header of this life (damaged, never written, stale bytes of the segment's previous
life: those carry seqs below its start seq) does not end the walk: it resynchronises on the
next 4 KiB block that holds a header of this life with a seq above the last one kept, so one
damaged header costs exactly its own record. A walked segment is given a summary afterwards,
so the next open reads it directly.

At the end of the newest segment, a trailing run of records whose payload fails its checksum
is a write torn by a crash: it is cut, and the cut is persisted by zeroing every torn header
(a resynchronising walk would otherwise find the second one) and rewriting the summary.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import chain, repeat
from operator import itemgetter
from typing import NamedTuple

from kvpool.errors import CorruptRecordError
from kvpool.record import (
    BLOCK,
    EPOCH_SHIFT,
    FLAG_NS_TOMBSTONE,
    FLAG_TOMBSTONE,
    HEADER_BLOCK,
    MAGIC,
    RecordHeader,
    payload_checksum,
    record_size,
    unpack_header,
)
from kvpool.ssd import summary
from kvpool.ssd.directio import aligned_buffer
from kvpool.ssd.segments import SegmentStore, unpack_segment_header

log = logging.getLogger("kvpool.ssd")

WALK_WINDOW = 256 << 10  # read-ahead while walking records of at most SMALL_RECORD bytes
SMALL_RECORD = 32 << 10
RESYNC_WINDOW = 1 << 20  # read size while looking for the next valid header


class FoundRecord(NamedTuple):
    seq: int
    segment: int
    block: int  # offset of the header block, in 4 KiB blocks
    blocks: int  # record size in 4 KiB blocks
    key: bytes
    namespace_id: bytes
    flags: int

    @property
    def offset(self) -> int:
        return self.block * BLOCK

    @property
    def is_tombstone(self) -> bool:
        return bool(self.flags & (FLAG_TOMBSTONE | FLAG_NS_TOMBSTONE))


@dataclass
class ScannedSegment:
    start_seq: int
    end: int  # first byte after the segment's last valid record
    summarized: bool = False  # its records came from a valid summary on the media
    skipped_blocks: int = 0  # blocks a walk stepped over looking for the next header


@dataclass
class Scan:
    """What the media holds: per segment its scan (None = free), records in seq order."""

    segments: list[ScannedSegment | None]
    records: list[FoundRecord] = field(default_factory=list)
    torn_discarded: int = 0

    @property
    def max_seq(self) -> int:
        seqs = [s.start_seq for s in self.segments if s is not None]
        return max([*seqs, *(r.seq for r in self.records[-1:])], default=0)


def scan_media(store: SegmentStore, tail_verify_bytes: int, threads: int = 4) -> Scan:
    """Read every segment's header and summary (or walk its record headers; IO errors read as
    damaged blocks). Segments are independent, so ``threads`` of them are scanned at once.
    Payloads in the last ``tail_verify_bytes`` of the newest segment are re-verified
    (ssd.tail_verify_bytes) and a trailing run of bad ones is cut as a torn tail.
    Writes only to persist a torn-tail cut and to give walked segments a summary (a failed
    write there is logged, never raised)."""
    result = Scan(segments=[None] * store.count)
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="kvpool-ssd-scan") as pool:
        scans = list(pool.map(lambda seg_no: _scan_segment(store, seg_no), range(store.count)))
    per_segment: dict[int, list[FoundRecord]] = {}
    for seg_no, scanned in enumerate(scans):
        if scanned is not None:
            result.segments[seg_no], per_segment[seg_no] = scanned
    if per_segment:
        newest = max(per_segment, key=lambda s: scans[s][0].start_seq)  # type: ignore[index]
        result.torn_discarded = _discard_torn_tail(store, newest, result, per_segment,
                                                   tail_verify_bytes)
    for seg_no, records in per_segment.items():
        scanned_seg = result.segments[seg_no]
        assert scanned_seg is not None
        if not scanned_seg.summarized:
            _write_summary(store, seg_no, scanned_seg, records)
    # Segment lives hold disjoint seq ranges, so in start-seq order this is already sorted
    # (the sort only checks that, in C).
    order = sorted(per_segment, key=lambda s: scans[s][0].start_seq)  # type: ignore[index]
    result.records = sorted(chain.from_iterable(per_segment[s] for s in order),
                            key=itemgetter(0))
    return result


def _scan_segment(store: SegmentStore,
                  seg_no: int) -> tuple[ScannedSegment, list[FoundRecord]] | None:
    """One segment's header and records; None for a free (or unreadable, or foreign) one."""
    block = memoryview(aligned_buffer(BLOCK))
    try:
        if os.preadv(store.fd(seg_no), [block], store.base(seg_no)) != BLOCK:
            return None
    except OSError:
        return None
    sh = unpack_segment_header(block)
    if sh is None or sh.segment_size != store.segment_size or sh.number != seg_no:
        return None
    found = summary.read(store, seg_no, sh.start_seq)
    if found is not None:
        return _from_summary(seg_no, sh.start_seq, found)
    return walk_segment(store, seg_no, sh.start_seq)


def _from_summary(seg_no: int, start_seq: int,
                  found: summary.Summary) -> tuple[ScannedSegment, list[FoundRecord]]:
    e = found.entries
    ns_of = found.ns_ids
    columns = zip(e["seq"].tolist(), repeat(seg_no, e.size), e["block"].tolist(),
                  e["blocks"].tolist(), e["key"].tolist(), [ns_of[i] for i in e["ns"].tolist()],
                  e["flags"].tolist(), strict=True)
    # tuple.__new__ builds each FoundRecord in C: a NamedTuple's own __new__ is Python code
    # and would be most of the cost of an open
    records: list[FoundRecord] = list(map(tuple.__new__, repeat(FoundRecord), columns))
    end = (records[-1].block + records[-1].blocks) * BLOCK if records else HEADER_BLOCK
    return ScannedSegment(start_seq, end, summarized=True), records


class _Reader:
    """A segment's blocks through one aligned window buffer: a walk of small records reads
    many headers per IO. A failed window read is retried block by block; a short read marks
    the end of what the media holds."""

    def __init__(self, store: SegmentStore, seg_no: int) -> None:
        self._fd, self._base = store.fd(seg_no), store.base(seg_no)
        self.limit = store.segment_size
        self._buf = memoryview(aligned_buffer(RESYNC_WINDOW))
        self._lo = self._hi = 0

    def block(self, offset: int, ahead: int) -> memoryview | None:
        """The 4 KiB block at ``offset``, reading up to ``ahead`` bytes from there if it is
        not buffered; None if it cannot be read."""
        if self._lo <= offset and offset + BLOCK <= self._hi:
            return self._buf[offset - self._lo:offset - self._lo + BLOCK]
        want = max(BLOCK, min(ahead, len(self._buf), self.limit - offset))
        self._lo = self._hi = 0
        for n in (want, BLOCK) if want > BLOCK else (BLOCK,):
            try:
                got = os.preadv(self._fd, [self._buf[:n]], self._base + offset)
            except OSError:
                continue
            if got < n:
                self.limit = offset + got // BLOCK * BLOCK
            self._lo, self._hi = offset, offset + got // BLOCK * BLOCK
            return self._buf[:BLOCK] if got >= BLOCK else None
        return None


def _header_at(block: memoryview | None) -> RecordHeader | None:
    if block is None or block[:4] != MAGIC:
        return None
    try:
        return unpack_header(block)
    except CorruptRecordError:
        return None


def walk_segment(store: SegmentStore, seg_no: int,
          start_seq: int) -> tuple[ScannedSegment, list[FoundRecord]]:
    """Follow the record headers from the segment's first record to its end, resynchronising
    on the next header of this life wherever a block is not one (see the module doc). One
    read per header (fewer for small records); block by block only through damage and
    through the never-written rest of the segment."""
    reader = _Reader(store, seg_no)
    size = store.segment_size
    epoch = start_seq >> EPOCH_SHIFT
    records: list[FoundRecord] = []
    offset = end = HEADER_BLOCK
    prev_seq, ahead, skipped, gap = start_seq, WALK_WINDOW, 0, 0
    while offset + HEADER_BLOCK <= reader.limit:
        h = _header_at(reader.block(offset, ahead))
        rsize = record_size(h.payload_len) if h is not None else 0
        # A header of this life: its seq follows the last one kept, in the segment's epoch
        # (stale headers of earlier lives have seqs below start_seq), and the record fits.
        if (h is None or h.seq <= prev_seq or h.seq >> EPOCH_SHIFT != epoch
                or offset + rsize > size):
            offset += BLOCK
            ahead = RESYNC_WINDOW
            gap += 1
            continue
        records.append(FoundRecord(h.seq, seg_no, offset // BLOCK, rsize // BLOCK, h.key,
                                   h.namespace_id, h.flags))
        prev_seq, offset = h.seq, offset + rsize
        end, skipped, gap = offset, skipped + gap, 0  # a gap before the last record is damage
        ahead = WALK_WINDOW if rsize <= SMALL_RECORD else BLOCK
    if skipped:
        log.warning("ssd: segment %d: stepped over %d unreadable or invalid block(s) between "
                    "records; the records after them were kept", seg_no, skipped)
    return ScannedSegment(start_seq, end, skipped_blocks=skipped), records


def _write_summary(store: SegmentStore, seg_no: int, scanned: ScannedSegment,
                   records: list[FoundRecord]) -> None:
    """Give a walked (or cut) segment a summary of what was found, if it has room for one
    (media written by a kvpool without summaries may not); IO errors are logged."""
    ns_index: dict[bytes, int] = {}
    entries = [summary.SummaryEntry(r.key, r.block, r.blocks, r.seq,
                                    ns_index.setdefault(r.namespace_id, len(ns_index)), r.flags)
               for r in records]
    if scanned.end + summary.room(len(entries), len(ns_index)) > store.segment_size:
        return
    try:
        summary.write(store, seg_no, entries, list(ns_index), scanned.start_seq)
        store.sync(seg_no)
    except OSError as exc:
        log.warning("ssd: could not write the summary of segment %d: %s", seg_no, exc)
        return
    scanned.summarized = True


def _discard_torn_tail(store: SegmentStore, seg_no: int, result: Scan,
                       per_segment: dict[int, list[FoundRecord]], verify_bytes: int) -> int:
    """Cut the trailing run of bad-payload records of the newest segment. A bad record
    followed by a good one is not cut: it stays, its reads become counted misses, and the
    acknowledged records after it survive. (Durable writes are ordered, so there it is
    damage; in cache mode two write-behind writers may also leave a batch torn before a
    later batch that was written whole.) Returns records cut."""
    scanned = result.segments[seg_no]
    assert scanned is not None
    mine = per_segment[seg_no]
    tail_start = scanned.end - verify_bytes
    torn: list[FoundRecord] = []
    for record in reversed(mine):
        if record.offset < tail_start or record.is_tombstone or payload_ok(store, record):
            break
        torn.append(record)
    if not torn:
        return 0
    del mine[len(mine) - len(torn):]
    # Persist the cut: zeroed headers are not records to any later walk, and the summary
    # rewritten after this no longer lists them, so the torn records do not come back once
    # this segment is no longer the newest.
    zero = memoryview(aligned_buffer(BLOCK))
    for record in torn:
        os.pwritev(store.fd(seg_no), [zero], store.base(seg_no) + record.offset)
    store.sync(seg_no)
    scanned.end = torn[-1].offset
    scanned.summarized = False
    log.warning("ssd: discarded %d torn record(s) at the log tail", len(torn))
    return len(torn)


def payload_ok(store: SegmentStore, record: FoundRecord) -> bool:
    """The record's header still names it and its payload matches the header's checksum."""
    buf = memoryview(aligned_buffer(record.blocks * BLOCK))
    try:
        n = os.preadv(store.fd(record.segment), [buf], store.base(record.segment) + record.offset)
        h = unpack_header(buf)
    except (OSError, CorruptRecordError):
        return False
    return (h.key == record.key and h.seq == record.seq
            and record_size(h.payload_len) == record.blocks * BLOCK
            and n >= HEADER_BLOCK + h.payload_len
            and payload_checksum(buf[HEADER_BLOCK:HEADER_BLOCK + h.payload_len]) == h.checksum)
