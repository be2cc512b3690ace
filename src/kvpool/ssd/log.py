"""The SSD engine's log of segments: each one free, active (the head) or sealed, oldest first.

Writers reserve room at the head of the active segment under the engine lock and write outside
it; the segment's ``inflight`` count covers those writes. When the next record does not fit,
the active segment is sealed (once its in-flight writes are done, its summary is written at
its end: summary.py) and a free one opened; when none is free the oldest sealed segment
is freed whole (once its in-flight writes finish), its recently read records copied forward to
the new head as the segment policy picks them. A roll, like an append, does its IO outside
the lock: writers wait for it, readers and index probes do not (``_roll``).

Not thread-safe by itself: every method is called with the engine lock held (the lock of the
``cond`` it is given) and may wait on ``cond``, releasing it; ``_roll`` also releases it
around its IO.
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
from kvpool.errors import CorruptRecordError, PoolClosedError
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
from kvpool.ssd.recency import ReadMarks
from kvpool.ssd.recovery import Scan
from kvpool.ssd.segments import SegmentHeader, SegmentStore
from kvpool.ssd.writer import MAX_IOV, Pending, pwritev_all

log = logging.getLogger("kvpool.ssd")

FREE, ACTIVE, SEALED = 0, 1, 2
#: How many keys of hot records dropped over the copy-forward budget are remembered for the
#: pool to write back from DRAM.
HOT_DROPPED_KEYS = 1 << 14


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
                 counters: Counters, marks: ReadMarks | None = None) -> None:
        self._store = store
        self._index = index
        self._cond = cond
        self._policy = policy
        self._forward_budget_blocks = forward_budget_blocks
        self._durable = durable
        self._counters = counters
        self._marks = marks
        self.segments = [Segment() for _ in range(store.count)]
        self.fifo: deque[int] = deque()  # sealed segments, oldest first
        self.free: list[int] = []
        self._active = -1
        self._rolling = False
        self._hot_dropped = 0  # of the roll in progress, for its log line
        #: Keys of hot records dropped over the copy-forward budget, newest last, for the
        #: pool to write back from DRAM (SsdEngine.take_hot_dropped); the oldest go first.
        self.hot_dropped_keys: deque[bytes] = deque(maxlen=HOT_DROPPED_KEYS)
        self._closed = False
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
        Returns how many were placed; lock held. Raises PoolClosedError once ``close`` was
        called, and what ``_roll`` raises."""
        while self._rolling:
            self._cond.wait()
        if self._closed:
            raise PoolClosedError("SSD engine is closed")
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
        """Wait until no segment has writes in flight and no roll is doing IO; lock held."""
        while self._rolling or any(s.inflight for s in self.segments):
            self._cond.wait()

    def close(self) -> None:
        """No reservation succeeds after this (a writer waiting for a roll is refused when it
        wakes); lock held. The engine then waits for ``wait_idle`` before closing fds."""
        self._closed = True

    def _roll(self) -> None:
        """Seal the active segment and open a fresh one, evicting the oldest if none is free,
        its hot records copied forward to the new head.

        Called with the lock held. Writers wait for the whole roll (``_rolling``); readers
        and index probes do not: the lock is dropped for every IO (the summary, the
        copy-forward reads, the new segment header, the forward writes) and taken only to
        change the bookkeeping. The index never points at bytes being overwritten: the
        victim's entries go before the victim is reused as the new head, and a copied-forward
        record is indexed again only once its new copy has landed (synced, in durable mode),
        so in between it reads as absent. Raises OSError when the new segment header cannot
        be written (the segment goes back to the free list; the next writer tries again);
        a failed summary or forward write is logged and costs only what it wrote."""
        self._rolling = True
        try:
            sealed = self._seal_active()
            victim, picked = self._pick_victim() if not self.free else (-1, [])
            forward: list[tuple[bytes, int, memoryview]] = []
            dropped = 0
            self._cond.release()
            try:
                if sealed is not None:
                    self._write_summary(*sealed)
                forward = self._read_forward(victim, picked)
            finally:
                self._cond.acquire()
                if victim >= 0:  # even after an unexpected error: never leak the segment
                    dropped = self._evict(victim, len(forward))
            seg_no = self.free.pop()
            seg = self.segments[seg_no] = Segment(ACTIVE, self._next_seq())
            placed = self._place_forward(seg, forward)
            self._cond.release()
            if victim >= 0:  # logged off the lock: readers do not wait for the log's IO
                log.info("ssd: evicted segment %d: %d records dropped (%d of them read since "
                         "written: over ssd.copy_forward_fraction), %d copied forward",
                         victim, dropped, self._hot_dropped, len(placed),
                         extra={"event": "segment_evicted", "segment": victim,
                                "records_dropped": dropped, "hot_dropped": self._hot_dropped,
                                "copied_forward": len(placed)})
            try:
                landed = self._write_head(seg_no, seg.start_seq, placed)
            except BaseException:
                self._cond.acquire()
                self.segments[seg_no] = Segment()
                self.free.append(seg_no)
                self._counters.add("records_evicted", len(placed))
                raise
            self._cond.acquire()
            self._active = seg_no
            self._index_forward(seg_no, seg, placed, landed)
        finally:
            self._rolling = False
            self._cond.notify_all()

    def _seal_active(self) -> tuple[int, list[summary.SummaryEntry], list[bytes], int] | None:
        """Seal the active segment once the writes reserved in it are done; returns what its
        summary is written from (outside the lock). Lock held."""
        seg_no = self._active
        if seg_no < 0:
            return None
        seg = self.segments[seg_no]
        while seg.inflight:
            self._cond.wait()
        seg.state = SEALED
        self.fifo.append(seg_no)
        self._active = -1
        entries = [e for e in seg.entries if e.seq not in seg.failed]
        sealed = (seg_no, entries, list(seg.ns_table), seg.start_seq)
        seg.entries, seg.ns_table, seg.failed = [], {}, set()
        return sealed

    def _write_summary(self, seg_no: int, entries: list[summary.SummaryEntry],
                       ns_ids: list[bytes], start_seq: int) -> None:
        """The sealed segment's summary (synced in durable mode). A failed write is logged,
        not raised: the segment is then walked on the next open."""
        try:
            summary.write(self._store, seg_no, entries, ns_ids, start_seq)
            if self._durable:
                self._store.sync(seg_no)
        except OSError as exc:
            log.warning("ssd: could not write the summary of segment %d: %s", seg_no, exc)

    def _pick_victim(self) -> tuple[int, list[tuple[bytes, int, int, int]]]:
        """Take the oldest sealed segment off the log and pick, by the segment policy, the
        records to copy forward: (key, ns_index, offset, size) each. Its entries stay indexed
        (and readable) until ``_evict``. Lock held."""
        victim = self.fifo.popleft()
        while self.segments[victim].inflight:
            self._cond.wait()
        if self._marks is not None and len(self._marks):  # reads served above the SSD
            self._counters.add("marked_reads",
                               self._index.mark_hot_many(self._marks.take()))
        block_col, blocks_col = self._index.column("block"), self._index.column("blocks")
        slots = self._index.slots_where(segment=victim)
        # in write order (the index's slots are in hash order): the budget then keeps the
        # oldest hot records, a prefix's head before its tail, and the forwarded records are
        # rewritten in the order they were written, so a prefix stays one coalesced read
        slots = slots[np.argsort(block_col[slots], kind="stable")]
        hot = self._index.column("hot")[slots].astype(bool)
        picked = self._policy.copy_forward(hot, blocks_col[slots].astype(np.int64),
                                           self._forward_budget_blocks)
        # read since written but over the copy-forward budget: dropped although hot
        over = np.flatnonzero(hot)
        over = over[~np.isin(over, picked)]
        self._hot_dropped = int(over.size)
        self._counters.add("hot_dropped", self._hot_dropped)
        self.hot_dropped_keys.extend(self._index.key_at(int(slot)) for slot in slots[over])
        ns_col = self._index.column("ns_index")
        return victim, [(self._index.key_at(int(slot)), int(ns_col[slot]),
                         int(block_col[slot]) * BLOCK, int(blocks_col[slot]) * BLOCK)
                        for slot in slots[picked]]

    def _read_block(self, segment: int, offset: int, out: memoryview) -> int:
        return os.preadv(self._store.fd(segment), [out], self._store.base(segment) + offset)

    def _read_forward(self, victim: int, picked: list[tuple[bytes, int, int, int]]
                      ) -> list[tuple[bytes, int, memoryview]]:
        """Read and verify the picked records of ``victim`` (lock not held): (key, ns_index,
        record) for each intact one. A failed read is an io_error, a record that fails its
        checks a checksum_failure; either is dropped."""
        forward: list[tuple[bytes, int, memoryview]] = []
        for key, ns_index, offset, size in picked:
            buf = memoryview(aligned_buffer(size))
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
                forward.append((key, ns_index, buf))
            else:  # damaged since it was written
                self._counters.add("checksum_failures")
        return forward

    def _evict(self, victim: int, forwarded: int) -> int:
        """Drop every entry still in ``victim`` (copied-forward ones come back in
        ``_index_forward``) and free it; returns the records dropped. Lock held."""
        slots = self._index.slots_where(segment=victim)
        self._index.remove_slots(slots)
        dropped = max(0, int(slots.size) - forwarded)
        self._counters.add("segments_evicted")
        self._counters.add("records_evicted", dropped)
        self.segments[victim] = Segment()
        self.free.append(victim)
        return dropped

    def _place_forward(self, seg: Segment, forward: list[tuple[bytes, int, memoryview]]
                       ) -> list[tuple[int, int, RecordHeader, memoryview]]:
        """Give each copied-forward record a new seq and its offset at the new head (each
        buffer's header rewritten): (ns_index, offset, header, record). Lock held."""
        placed = []
        for key, ns_index, buf in forward:
            old = unpack_header(buf)
            if not seg.fits(len(buf), old.namespace_id, self._store.segment_size):
                # the budget is a fraction: rare
                self._counters.add_many({"records_evicted": 1, "hot_dropped": 1})
                self._hot_dropped += 1
                self.hot_dropped_keys.append(key)
                continue
            new = RecordHeader(key, old.namespace_id, old.layout_id, old.payload_len,
                               self._next_seq(), old.checksum, old.flags)
            new.pack_into(buf)
            offset = seg.write_off
            seg.place(new, offset, len(buf))
            placed.append((ns_index, offset, new, buf))
        return placed

    def _write_head(self, seg_no: int, start_seq: int,
                    placed: list[tuple[int, int, RecordHeader, memoryview]]) -> bool:
        """Write the new segment's header, then the copied-forward records after it, synced
        in durable mode (lock not held). Raises OSError if the header cannot be written;
        returns False if the records could not (logged and counted: they are dropped)."""
        header = SegmentHeader(self._store.segment_size, seg_no, start_seq).pack()
        fd, base = self._store.fd(seg_no), self._store.base(seg_no)
        os.pwritev(fd, [header], base)
        if self._durable and not placed:
            self._store.sync(seg_no)
        if not placed:
            return True
        try:
            bufs = [buf for _, _, _, buf in placed]
            for i in range(0, len(bufs), MAX_IOV):  # consecutive: one pwritev per MAX_IOV
                pwritev_all(fd, bufs[i:i + MAX_IOV], base + placed[i][1])
            if self._durable:
                self._store.sync(seg_no)
        except OSError as exc:
            self._counters.add("io_errors")
            log.warning("ssd: copy-forward write error %s; %d records dropped", exc,
                        len(placed))
            return False
        return True

    def _index_forward(self, seg_no: int, seg: Segment,
                       placed: list[tuple[int, int, RecordHeader, memoryview]],
                       landed: bool) -> None:
        """Index the copied-forward records that landed; the summary leaves out the others.
        A key indexed again meanwhile (a newer copy) keeps its newer entry. Lock held."""
        for ns_index, offset, header, buf in placed:
            if not landed or header.key in self._index:
                seg.failed.add(header.seq)
                if not landed:
                    self._counters.add("records_evicted")
                continue
            self._index.put(header.key, seg_no, offset // BLOCK, len(buf) // BLOCK, ns_index)
            self._counters.add_many({"copied_forward": 1, "log_bytes": len(buf)})
