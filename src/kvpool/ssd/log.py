"""The SSD engine's log of segments: each one free, active (the head) or sealed, oldest first.

Writers reserve room at the head of the active segment under the engine lock and write outside
it; the segment's ``inflight`` count covers those writes. When the next record does not fit,
the active segment is sealed (once its in-flight writes are done, its summary is written at
its end: summary.py) and a free one opened; when none is free the oldest sealed segment
is freed whole (once its in-flight writes finish), its recently read records copied forward to
the new head as the segment policy picks them.

Not thread-safe by itself: every method is called with the engine lock held (the lock of the
``cond`` it is given) and may wait on ``cond``, releasing it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvpool.counters import Counters
from kvpool.errors import CorruptRecordError
from kvpool.policy.segments import SegmentPolicy
from kvpool.record import (
    BLOCK,
    EPOCH_SHIFT,
    HEADER_BLOCK,
    RecordHeader,
    payload_checksum,
    record_size,
    unpack_header,
)
from kvpool.ssd import summary
from kvpool.ssd.directio import aligned_buffer
from kvpool.ssd.index import CompactIndex
from kvpool.ssd.recovery import Scan
from kvpool.ssd.segments import SegmentHeader, SegmentStore
from kvpool.ssd.writer import Pending

log = logging.getLogger("kvpool.ssd")

FREE, ACTIVE, SEALED = 0, 1, 2


@dataclass(slots=True)
class Segment:
    state: int = FREE
    start_seq: int = 0
    write_off: int = HEADER_BLOCK  # next free byte, relative to the segment base
    inflight: int = 0
    # The active segment's future summary: its records so far, its namespace table, and the
    # seqs of records whose write failed (left out of the summary).
    entries: list[summary.SummaryEntry] = field(default_factory=list)
    ns_table: dict[bytes, int] = field(default_factory=dict)
    failed: set[int] = field(default_factory=set)

    def fits(self, size: int, namespace_id: bytes, segment_size: int) -> bool:
        """Whether a record of ``size`` bytes fits at the head with room left for the
        summary that will list it."""
        namespaces = len(self.ns_table) + (namespace_id not in self.ns_table)
        return (self.write_off + size + summary.room(len(self.entries) + 1, namespaces)
                <= segment_size)

    def place(self, header: RecordHeader, offset: int, size: int) -> None:
        ns = self.ns_table.setdefault(header.namespace_id, len(self.ns_table))
        self.entries.append(summary.SummaryEntry(header.key, offset // BLOCK, size // BLOCK,
                                                 header.seq, ns, header.flags))
        self.write_off = offset + size


class SegmentLog:
    """Segment states, the log head and eviction. Evicting a segment drops its entries from
    ``index``; copying a record forward re-points its entry. Counts evictions and copies in
    the engine's ``counters``."""

    def __init__(self, store: SegmentStore, index: CompactIndex, cond: threading.Condition,
                 policy: SegmentPolicy, forward_budget_blocks: int, durable: bool,
                 counters: Counters) -> None:
        self._store = store
        self._index = index
        self._cond = cond
        self._policy = policy
        self._forward_budget_blocks = forward_budget_blocks
        self._durable = durable
        self._counters = counters
        self.segments = [Segment() for _ in range(store.count)]
        self.fifo: deque[int] = deque()  # sealed segments, oldest first
        self.free: list[int] = []
        self._active = -1
        self._rolling = False
        self._seq = 0

    def restore(self, scan: Scan) -> None:
        """Take the segments found on the media; the first seq of this open is a new epoch,
        above every seq the media may hold."""
        for seg_no, scanned in enumerate(scan.segments):
            if scanned is None:
                self.free.append(seg_no)
            else:
                seg = self.segments[seg_no]
                seg.state, seg.start_seq, seg.write_off = SEALED, scanned.start_seq, scanned.end
        self.fifo.extend(sorted((i for i, s in enumerate(self.segments) if s.state == SEALED),
                                key=lambda i: self.segments[i].start_seq))
        self._seq = ((scan.max_seq >> EPOCH_SHIFT) + 1) << EPOCH_SHIFT

    def used_bytes(self) -> int:
        return sum(s.write_off for s in self.segments if s.state != FREE)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def reserve(self, pending: list[Pending], start: int) -> int:
        """Place records from ``pending[start:]`` into the active segment (rolling first if
        the next one does not fit) and count the batch in flight there until ``release``.
        Returns how many were placed; lock held."""
        while self._rolling:
            self._cond.wait()
        segment_size = self._store.segment_size
        first = pending[start]
        size = record_size(first.payload.nbytes)
        if self._active < 0 or not self.segments[self._active].fits(
                size, first.header.namespace_id, segment_size):
            self._roll()
        seg = self.segments[self._active]
        placed = 0
        for p in pending[start:]:
            size = record_size(p.payload.nbytes)
            if not seg.fits(size, p.header.namespace_id, segment_size):
                break
            p.segment, p.offset = self._active, seg.write_off
            p.header = RecordHeader(p.header.key, p.header.namespace_id, p.header.layout_id,
                                    p.header.payload_len, self._next_seq(), p.header.checksum,
                                    p.header.flags)
            seg.place(p.header, p.offset, size)
            placed += 1
        seg.inflight += 1
        return placed

    def release(self, seg_no: int, failed: Sequence[Pending] = ()) -> None:
        """A batch reserved in ``seg_no`` is done; ``failed`` lists its records if the write
        failed (the segment's summary leaves them out). Lock held."""
        seg = self.segments[seg_no]
        seg.failed.update(p.header.seq for p in failed)
        seg.inflight -= 1
        self._cond.notify_all()

    def wait_idle(self) -> None:
        """Wait until no segment has writes in flight; lock held."""
        while any(s.inflight for s in self.segments):
            self._cond.wait()

    def _roll(self) -> None:
        """Seal the active segment and open a fresh one, evicting the oldest if none is free.
        Called with the lock held; may wait (releasing it) for writes into the victim."""
        self._rolling = True
        try:
            self._seal_active()
            forward: list[tuple[bytes, int, memoryview]] = []
            if not self.free:
                forward = self._evict_oldest()
            seg_no = self.free.pop()
            seg = self.segments[seg_no] = Segment(ACTIVE, self._next_seq())
            header = SegmentHeader(self._store.segment_size, seg_no, seg.start_seq).pack()
            os.pwritev(self._store.fd(seg_no), [header], self._store.base(seg_no))
            if self._durable:
                self._store.sync(seg_no)
            self._active = seg_no
            self._write_forward(forward)
        finally:
            self._rolling = False
            self._cond.notify_all()

    def _seal_active(self) -> None:
        """Seal the active segment: once the writes reserved in it are done, write its
        summary (synced in durable mode). A failed summary write is logged, not raised: the
        segment is then walked on the next open."""
        seg_no = self._active
        if seg_no < 0:
            return
        seg = self.segments[seg_no]
        while seg.inflight:
            self._cond.wait()
        seg.state = SEALED
        self.fifo.append(seg_no)
        self._active = -1
        entries = [e for e in seg.entries if e.seq not in seg.failed]
        try:
            summary.write(self._store, seg_no, entries, list(seg.ns_table), seg.start_seq)
            if self._durable:
                self._store.sync(seg_no)
        except OSError as exc:
            log.warning("ssd: could not write the summary of segment %d: %s", seg_no, exc)
        seg.entries, seg.ns_table, seg.failed = [], {}, set()

    def _read_block(self, segment: int, offset: int, out: memoryview) -> int:
        return os.preadv(self._store.fd(segment), [out], self._store.base(segment) + offset)

    def _evict_oldest(self) -> list[tuple[bytes, int, memoryview]]:
        victim = self.fifo.popleft()
        while self.segments[victim].inflight:
            self._cond.wait()
        slots = self._index.slots_where(segment=victim)
        picked = self._policy.copy_forward(self._index.column("hot")[slots].astype(bool),
                                           self._index.column("blocks")[slots].astype(np.int64),
                                           self._forward_budget_blocks)
        block_col, blocks_col = self._index.column("block"), self._index.column("blocks")
        ns_col = self._index.column("ns_index")
        forward: list[tuple[bytes, int, memoryview]] = []
        for slot in slots[picked]:
            key = self._index.key_at(int(slot))
            buf = memoryview(aligned_buffer(int(blocks_col[slot]) * BLOCK))
            offset = int(block_col[slot]) * BLOCK
            try:
                self._read_block(victim, offset, buf)
                h = unpack_header(buf)
            except OSError as exc:  # the medium failed, the record may be fine: not corruption
                self._counters.add("io_errors")
                log.warning("ssd: copy-forward read error %s; record dropped", exc)
                continue
            except CorruptRecordError:
                self._counters.add("checksum_failures")
                continue
            if h.key == key and payload_checksum(
                    buf[HEADER_BLOCK:HEADER_BLOCK + h.payload_len]) == h.checksum:
                forward.append((key, int(ns_col[slot]), buf))
            else:  # damaged since it was written: was dropped uncounted
                self._counters.add("checksum_failures")
        self._index.remove_slots(slots)
        self._counters.add("segments_evicted")
        self._counters.add("records_evicted", int(slots.size) - len(forward))
        self.segments[victim] = Segment()
        self.free.append(victim)
        return forward

    def _write_forward(self, forward: list[tuple[bytes, int, memoryview]]) -> None:
        """Rewrite copied-forward records (already verified) at the head with new seqs."""
        seg_no = self._active
        seg = self.segments[seg_no]
        for key, ns_index, buf in forward:
            old = unpack_header(buf)
            if not seg.fits(len(buf), old.namespace_id, self._store.segment_size):
                self._counters.add("records_evicted")  # the budget is a fraction: rare
                continue
            new = RecordHeader(key, old.namespace_id, old.layout_id, old.payload_len,
                               self._next_seq(), old.checksum, old.flags)
            new.pack_into(buf)
            offset = seg.write_off
            os.pwritev(self._store.fd(seg_no), [buf], self._store.base(seg_no) + offset)
            seg.place(new, offset, len(buf))
            self._index.put(key, seg_no, offset // BLOCK, len(buf) // BLOCK, ns_index)
            self._counters.add("copied_forward")
        if forward and self._durable:
            self._store.sync(seg_no)
