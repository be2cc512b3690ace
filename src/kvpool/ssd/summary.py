"""The per-segment summary: what a sealed segment holds, in one place, so an open reads it in
one or two IOs instead of walking every record header.

A summary sits at the very end of its segment: entries, then the segment's namespace table,
zero padding, and a 48-byte footer in the segment's last bytes. The log keeps room for it as
records are placed (``room``), so it never overlaps a record. It is written when the segment
is sealed (and by recovery for a segment it had to walk); a summary whose footer or body
checksum fails, or that names another segment or another life of this one (its start seq),
is ignored and the segment's headers are walked instead.

Entry (little-endian, 36 bytes): key 16s | block u32 (record offset / 4 KiB) |
    blocks u32 (record size / 4 KiB) | seq u64 | namespace u16 (index into the table) |
    flags u16 (the record's flags)
Namespace table: one 16-byte namespace id per index.
Footer: magic b"KVPX" | version u16 | flags u16 (0) | region bytes u32 (entries + table +
    padding + footer, a multiple of 4 KiB) | entries u32 | namespaces u32 | segment number u32
    | start seq u64 | xxh3-64 of entries + table u64 | xxh3-64 of the 40 bytes before it u64
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import xxhash

from kvpool.record import BLOCK, EPOCH_SHIFT, round_up
from kvpool.ssd.directio import aligned_buffer
from kvpool.ssd.segments import SegmentStore

SUMMARY_MAGIC = b"KVPX"
SUMMARY_VERSION = 1
NS_ID_BYTES = 16
_ENTRY = struct.Struct("<16sIIQHH")
_ENTRY_DTYPE = np.dtype([("key", "V16"), ("block", "<u4"), ("blocks", "<u4"), ("seq", "<u8"),
                         ("ns", "<u2"), ("flags", "<u2")])
_FOOTER_BODY = struct.Struct("<4sHHIIIIQQ")
_FOOTER_CHECK = struct.Struct("<Q")
FOOTER_SIZE = _FOOTER_BODY.size + _FOOTER_CHECK.size
assert _ENTRY.size == _ENTRY_DTYPE.itemsize == 36 and FOOTER_SIZE == 48


class SummaryEntry(NamedTuple):
    """One record of a segment as its summary lists it (``ns`` indexes the namespace table)."""

    key: bytes
    block: int
    blocks: int
    seq: int
    ns: int
    flags: int


def room(entries: int, namespaces: int) -> int:
    """Bytes at the segment's end that a summary of this many entries and namespaces takes."""
    return round_up(entries * _ENTRY.size + namespaces * NS_ID_BYTES + FOOTER_SIZE)


def pack(entries: Sequence[SummaryEntry], ns_ids: Sequence[bytes], number: int,
         start_seq: int, segment_size: int) -> tuple[int, memoryview]:
    """The summary as (offset in the segment, aligned buffer to write there)."""
    region = room(len(entries), len(ns_ids))
    buf = aligned_buffer(region)
    pos = 0
    for e in entries:
        _ENTRY.pack_into(buf, pos, *e)
        pos += _ENTRY.size
    for ns_id in ns_ids:
        buf[pos:pos + NS_ID_BYTES] = ns_id
        pos += NS_ID_BYTES
    body_hash = xxhash.xxh3_64_intdigest(memoryview(buf)[:pos])
    at = region - FOOTER_SIZE
    _FOOTER_BODY.pack_into(buf, at, SUMMARY_MAGIC, SUMMARY_VERSION, 0, region, len(entries),
                           len(ns_ids), number, start_seq, body_hash)
    _FOOTER_CHECK.pack_into(buf, at + _FOOTER_BODY.size,
                            xxhash.xxh3_64_intdigest(memoryview(buf)[at:at + _FOOTER_BODY.size]))
    return segment_size - region, memoryview(buf)


def write(store: SegmentStore, seg_no: int, entries: Sequence[SummaryEntry],
          ns_ids: Sequence[bytes], start_seq: int) -> None:
    """Write a segment's summary (one pwritev; no sync). Raises OSError on an IO error."""
    offset, buf = pack(entries, ns_ids, seg_no, start_seq, store.segment_size)
    os.pwritev(store.fd(seg_no), [buf], store.base(seg_no) + offset)


class Summary(NamedTuple):
    entries: np.ndarray  # of _ENTRY_DTYPE, validated
    ns_ids: list[bytes]
    region: int  # bytes at the segment's end the summary takes


def read(store: SegmentStore, seg_no: int, start_seq: int) -> Summary | None:
    """The segment's summary, or None if it has none that belongs to this life of the segment
    or it fails any check (checksums, bounds, seq order, overlapping records). IO errors read
    as None; never raises."""
    size = store.segment_size
    fd, base = store.fd(seg_no), store.base(seg_no)
    last = memoryview(aligned_buffer(BLOCK))
    try:
        if os.preadv(fd, [last], base + size - BLOCK) != BLOCK:
            return None
    except OSError:
        return None
    at = BLOCK - FOOTER_SIZE
    body_end = at + _FOOTER_BODY.size
    (stored,) = _FOOTER_CHECK.unpack_from(last, body_end)
    if bytes(last[at:at + 4]) != SUMMARY_MAGIC:
        return None
    if xxhash.xxh3_64_intdigest(last[at:body_end]) != stored:
        return None
    (_, version, _, region, count, ns_count, number, seq0,
     body_hash) = _FOOTER_BODY.unpack_from(last, at)
    body_len = count * _ENTRY.size + ns_count * NS_ID_BYTES
    if (version != SUMMARY_VERSION or number != seg_no or seq0 != start_seq
            or region % BLOCK or not BLOCK <= region <= size - BLOCK
            or body_len + FOOTER_SIZE > region):
        return None
    if region == BLOCK:
        whole = last
    else:
        whole = memoryview(aligned_buffer(region))
        try:
            if os.preadv(fd, [whole[:region - BLOCK]], base + size - region) != region - BLOCK:
                return None
        except OSError:
            return None
        whole[region - BLOCK:] = last
    body = whole[:body_len]
    if xxhash.xxh3_64_intdigest(body) != body_hash:
        return None
    entries = np.frombuffer(body, _ENTRY_DTYPE, count)
    ns_ids = [bytes(body[p:p + NS_ID_BYTES])
              for p in range(count * _ENTRY.size, body_len, NS_ID_BYTES)]
    if not _consistent(entries, ns_count, start_seq, (size - region) // BLOCK):
        return None
    return Summary(entries, ns_ids, region)


def _consistent(entries: np.ndarray, ns_count: int, start_seq: int, limit_block: int) -> bool:
    """Records in seq order, of this life (above start_seq, same epoch), inside the segment
    before the summary, not overlapping; namespaces inside the table."""
    if not entries.size:
        return True
    block = entries["block"].astype(np.int64)
    ends = block + entries["blocks"]
    seq = entries["seq"]
    return bool((entries["blocks"] >= 1).all() and (block >= 1).all()
                and (ends <= limit_block).all() and (block[1:] >= ends[:-1]).all()
                and int(seq[0]) > start_seq and (seq[1:] > seq[:-1]).all()
                and int(seq[-1]) >> EPOCH_SHIFT == start_seq >> EPOCH_SHIFT
                and (entries["ns"] < ns_count).all())
