"""Offline check of an SSD segment directory (``kvpool admin verify``): every record's header
and payload checksum, and each segment's summary against its records.

It reads with the engine's own code: segment headers (segments.py), the walk from one record
header to the next (recovery.py ``walk_segment``, which resynchronises past a damaged header
and counts the blocks it stepped over), the payload check (recovery.py ``payload_ok``) and the
summary reader (summary.py). The directory is opened read-only under the lock an engine takes
(``SegmentStore.open_read_only``), so a live pool cannot be writing it meanwhile; nothing is
written (a walked segment is not given a summary, a torn tail is not cut).

Per segment it counts good records (tombstones included: they have no payload to check), bad
ones (payload checksum or length wrong: a read of it would be a counted miss) and torn ones
(the trailing run of bad records at the end of the newest segment: a write a crash cut short,
which the next open discards). Damage is any bad or torn record, any block between records
that is not a valid header, a segment header that is damaged, or a summary that lists other
records than the segment holds. A sealed segment without a valid summary is not damage (the
next open walks it and writes one) and is reported as such.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvpool.record import BLOCK
from kvpool.ssd import summary
from kvpool.ssd.directio import aligned_buffer
from kvpool.ssd.recovery import FoundRecord, payload_ok, walk_segment
from kvpool.ssd.segments import SEGMENT_MAGIC, SegmentStore, unpack_segment_header

#: Bad records listed per segment in a report (the counts are always complete).
LISTED_BAD = 20


@dataclass
class SegmentReport:
    """One segment file. ``state``: ``used`` (a valid header of this directory's segment
    size), ``free`` (never written, or freed), ``damaged`` (its header fails its checksum),
    ``foreign`` (a valid header of another segment size or number), ``missing`` (no file)."""

    number: int
    state: str
    start_seq: int = 0
    good: int = 0
    bad: int = 0
    torn: int = 0
    tombstones: int = 0
    skipped_blocks: int = 0
    #: ``ok`` (matches the records), ``mismatch``, ``absent`` (none valid for this life).
    summary: str = "absent"
    summary_detail: str = ""
    bad_records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def damaged(self) -> bool:
        return bool(self.state == "damaged" or self.bad or self.torn or self.skipped_blocks
                    or self.summary == "mismatch")


@dataclass
class VerifyReport:
    path: str
    segment_size: int
    segments: list[SegmentReport]

    @property
    def damaged(self) -> bool:
        return any(s.damaged for s in self.segments)

    def totals(self) -> dict[str, int]:
        used = [s for s in self.segments if s.state == "used"]
        return {"segments": len(self.segments), "used": len(used),
                "good": sum(s.good for s in used), "bad": sum(s.bad for s in used),
                "torn": sum(s.torn for s in used),
                "skipped_blocks": sum(s.skipped_blocks for s in used),
                "damaged_segments": sum(s.damaged for s in self.segments),
                "summary_mismatches": sum(s.summary == "mismatch" for s in used)}

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "segment_size": self.segment_size,
                "clean": not self.damaged, "totals": self.totals(),
                "segments": [{**asdict(s), "damaged": s.damaged} for s in self.segments]}


def verify_directory(path: Path) -> VerifyReport:
    """Check every segment of the directory at ``path``. Raises CacheDirLockedError if an
    engine holds it, FileNotFoundError / NotADirectoryError for a path that is no directory,
    ValueError if it holds no segment file with a valid header (not an SSD directory of
    kvpool), OSError if a file cannot be opened. IO errors while reading records count those
    records as bad."""
    store = SegmentStore.open_read_only(path)
    try:
        if store.segment_size == 0:
            raise ValueError(f"{path}: no segment file (seg-NNNNN.kvs) with a valid segment "
                             "header; is this an SSD directory of kvpool (<cache_dir>/ssd)?")
        reports = [_header_report(store, n) for n in range(store.count)]
        used = [r for r in reports if r.state == "used"]
        newest = max(used, key=lambda r: r.start_seq).number if used else -1
        for report in used:
            _check_segment(store, report, report.number == newest)
        return VerifyReport(str(path), store.segment_size, reports)
    finally:
        store.close()


def _header_report(store: SegmentStore, number: int) -> SegmentReport:
    if store.fd(number) < 0:
        return SegmentReport(number, "missing")
    block = memoryview(aligned_buffer(BLOCK))
    try:
        got = os.preadv(store.fd(number), [block], store.base(number))
    except OSError:
        return SegmentReport(number, "damaged")
    header = unpack_segment_header(block) if got == BLOCK else None
    if header is None:
        return SegmentReport(number, "damaged" if bytes(block[:4]) == SEGMENT_MAGIC else "free")
    if header.segment_size != store.segment_size or header.number != number:
        return SegmentReport(number, "foreign")
    return SegmentReport(number, "used", start_seq=header.start_seq)


def _check_segment(store: SegmentStore, report: SegmentReport, newest: bool) -> None:
    scanned, records = walk_segment(store, report.number, report.start_seq)
    report.skipped_blocks = scanned.skipped_blocks
    verdicts = [r.is_tombstone or payload_ok(store, r) for r in records]
    torn = 0
    if newest:  # a trailing run of bad payloads at the log head: a write a crash cut short
        while torn < len(records) and not verdicts[-1 - torn] \
                and not records[-1 - torn].is_tombstone:
            torn += 1
    report.torn = torn
    report.tombstones = sum(r.is_tombstone for r in records)
    kept = len(records) - torn
    report.good = sum(verdicts[:kept])
    report.bad = kept - report.good
    report.bad_records = [_describe(r, "torn" if i >= kept else "bad payload")
                          for i, (r, ok) in enumerate(zip(records, verdicts, strict=True))
                          if not ok][:LISTED_BAD]
    _check_summary(store, report, records)


def _describe(record: FoundRecord, why: str) -> dict[str, Any]:
    return {"seq": record.seq, "offset": record.offset, "key": record.key.hex(),
            "namespace": record.namespace_id.hex(), "problem": why}


def _check_summary(store: SegmentStore, report: SegmentReport,
                   records: list[FoundRecord]) -> None:
    found = summary.read(store, report.number, report.start_seq)
    if found is None:
        report.summary = "absent"
        return
    e = found.entries
    listed = list(zip(e["seq"].tolist(), e["block"].tolist(), e["blocks"].tolist(),
                      e["key"].tolist(), [found.ns_ids[i] for i in e["ns"].tolist()],
                      e["flags"].tolist(), strict=True))
    walked = [(r.seq, r.block, r.blocks, r.key, r.namespace_id, r.flags) for r in records]
    if listed == walked:
        report.summary = "ok"
        return
    report.summary = "mismatch"
    only_listed = len(set(listed) - set(walked))
    only_walked = len(set(walked) - set(listed))
    report.summary_detail = (f"the summary lists {len(listed)} records, the segment holds "
                             f"{len(walked)}: {only_listed} listed but not found, "
                             f"{only_walked} found but not listed")
