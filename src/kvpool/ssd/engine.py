"""The SSD tier: a log-structured engine of large preallocated segments (DESIGN.md section 4).

Records (record.py) are appended at the head of the active segment with O_DIRECT; an in-memory
CompactIndex maps key -> (segment, block, blocks). On start the index is rebuilt from each
sealed segment's summary, or a walk of its self-describing records where it has none,
replayed in sequence order (tombstones replayed, a torn tail discarded). When the log is
full the oldest segment is freed whole; the segment policy may copy its recently read records
forward first. Segment states, the log head and eviction
live in log.py, laying records out into pwritev calls in writer.py, reading records back in
reader.py (one, or a run of back-to-back ones in one preadv), the checks that make a read a
hit or a miss in checks.py, the scan on open in recovery.py; this module holds the index and
the public API.

Failure contract: a read never returns bytes that fail the header or payload checksum, the key
check or the length check; such reads are counted misses. IO errors on reads are counted
misses. Misuse (wrong buffer size, closed engine) raises. In ``durable`` mode a put returns
only after fdatasync; in ``cache`` mode a crash may lose recent records but never corrupts.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np

from kvpool.buffers import byte_view
from kvpool.config import Config, SsdConfig
from kvpool.counters import Counters
from kvpool.errors import PoolClosedError
from kvpool.events.sink import TierEvents
from kvpool.keys import KEY_BYTES, Namespace, split_key_bytes
from kvpool.policy import make_segment_policy
from kvpool.record import (
    BLOCK,
    FLAG_NS_TOMBSTONE,
    FLAG_TOMBSTONE,
    RecordHeader,
    record_size,
)
from kvpool.ssd.checks import ReadChecks
from kvpool.ssd.directio import DirectMode, ThreadBuffers
from kvpool.ssd.index import CompactIndex, Location, NamespaceIds
from kvpool.ssd.log import SegmentLog
from kvpool.ssd.reader import plan_runs
from kvpool.ssd.recency import ReadMarks
from kvpool.ssd.recovery import scan_media
from kvpool.ssd.segments import SegmentStore, check_geometry
from kvpool.ssd.writer import Pending, hash_payloads, write_batch

log = logging.getLogger("kvpool.ssd")

Durability = Literal["cache", "durable"]

_DEFAULTS = SsdConfig()  # the tuning defaults of an engine built without a Config


class SsdEngine:
    """Log-structured SSD tier. Thread-safe; reads and writes from many threads run in
    parallel (writes serialise in ``durable`` mode so an acknowledged record never follows a
    hole in the log).

    Raises ValueError for bad geometry (segment size or read piece size not a multiple of
    4 KiB, fewer than two segments), CacheDirLockedError if another engine (any process, this
    one included) holds the directory or device, InsufficientSpaceError if the capacity does
    not fit in the free space, and OSError if the media cannot be opened or preallocated. A
    failed open leaves no fd open, no segment file it created and no lock behind (segments.py).
    """

    def __init__(self, path: str | os.PathLike[str], capacity: int,
                 segment_size: int = 256 << 20, durability: Durability = "cache",
                 io_threads: int = 4, direct_io: DirectMode = "auto",
                 eviction: str = "second_chance", copy_forward_fraction: float = 0.25, *,
                 read_pipeline_min_bytes: int = _DEFAULTS.read_pipeline_min_bytes,
                 read_piece_bytes: int = _DEFAULTS.read_piece_bytes,
                 read_pipeline_threads: int = _DEFAULTS.read_pipeline_threads,
                 tail_verify_bytes: int = _DEFAULTS.tail_verify_bytes,
                 coalesce_max_bytes: int = _DEFAULTS.coalesce_max_bytes) -> None:
        check_geometry(capacity, segment_size, read_piece_bytes)
        if durability not in ("cache", "durable"):
            raise ValueError(f"ssd.durability must be 'cache' or 'durable', got {durability!r}")
        self.durability: Durability = durability
        policy = make_segment_policy(eviction)
        forward_budget_blocks = int(copy_forward_fraction * segment_size) // BLOCK
        self._store = SegmentStore(Path(path), capacity, segment_size, direct_io)
        self.segment_size = segment_size
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._durable_lock = threading.Lock()
        self._index = CompactIndex()
        self._ns = NamespaceIds()
        self._closed = False
        self._tls = ThreadBuffers()
        self._io_threads = io_threads
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="kvpool-ssd")
        # A single large get_into is read in pieces so the checksum overlaps the IO (batched
        # reads already overlap one another on the IO pool and are not split).
        self._pipeline_min, self._piece = read_pipeline_min_bytes, read_piece_bytes
        self._tail_verify = tail_verify_bytes
        self._coalesce_max = coalesce_max_bytes  # a batch's back-to-back records: one read
        self._pieces = ThreadPoolExecutor(read_pipeline_threads,
                                          thread_name_prefix="kvpool-ssd-piece")
        self._counters = Counters(  # bumped on IO threads too
            "puts", "put_bytes", "gets", "hits", "misses", "checksum_failures", "stale_reads",
            "io_errors", "segments_evicted", "records_evicted", "copied_forward",
            "torn_discarded", "deletes", "namespace_mismatch", "coalesced_reads",
            "coalesced_records", "hot_dropped", "marked_reads")
        # reads served above the SSD (DRAM hits, replica touches), for copy-forward
        self._marks = ReadMarks()
        self._checks = ReadChecks(self._store, self._tls, self._pieces, self._counters,
                                  self._lock, self._index, self._ns, self._pipeline_min,
                                  self._piece)
        try:
            # The log shares the engine lock (through _cond), the index and the counters.
            self._log = SegmentLog(self._store, self._index, self._cond, policy,
                                   forward_budget_blocks, durability == "durable",
                                   self._counters, self._marks)
            self._recover()
        except BaseException:
            self._io.shutdown(wait=True)
            self._pieces.shutdown(wait=True)
            self._store.close()  # fds and the lock: a failed open holds nothing
            raise

    @classmethod
    def from_config(cls, cfg: Config) -> SsdEngine:
        """The engine ``cfg.ssd`` describes, at ``cfg.ssd_path()``; raises as the constructor."""
        s = cfg.ssd
        return cls(cfg.ssd_path(), s.capacity, s.segment_size, s.durability, s.io_threads,
                   s.direct_io, s.eviction, s.copy_forward_fraction,
                   read_pipeline_min_bytes=s.read_pipeline_min_bytes,
                   read_piece_bytes=s.read_piece_bytes,
                   read_pipeline_threads=s.read_pipeline_threads,
                   tail_verify_bytes=s.tail_verify_bytes,
                   coalesce_max_bytes=s.coalesce_max_bytes)

    # ------------------------------------------------------------------ properties
    @property
    def direct_io(self) -> bool:
        return self._store.direct

    @property
    def max_payload(self) -> int:
        # segment header, record header, and the smallest summary (one block) at the end
        return self.segment_size - 3 * BLOCK

    def __len__(self) -> int:
        return len(self._index)

    def index_bytes_per_chunk(self) -> float:
        with self._lock:
            return self._index.nbytes() / max(1, len(self._index))

    # ------------------------------------------------------------------ recovery
    def _recover(self) -> None:
        """Rebuild segments and index from the media (the log starts a new seq epoch):
        records replayed in seq order, so tombstones drop exactly what was written before
        them."""
        scan = scan_media(self._store, threads=self._io_threads,
                          tail_verify_bytes=self._tail_verify)
        self._log.restore(scan)
        self._counters.add("torn_discarded", scan.torn_discarded)
        self._index.reserve(len(self._index) + len(scan.records))
        put, ns_index = self._index.put, self._ns.number  # the common case, without _replay
        for r in scan.records:
            if r.flags:
                self._replay(r.key, r.namespace_id, r.flags, r.segment, r.block, r.blocks)
            else:
                put(r.key, r.segment, r.block, r.blocks, ns_index(r.namespace_id))
        if scan.records:
            log.info("ssd: recovered %d records in %d segments", len(self._index),
                     len(self._log.fifo), extra={"event": "ssd_recovered",
                                                 "records": len(self._index),
                                                 "segments": len(self._log.fifo)})

    def _apply(self, h: RecordHeader, seg_no: int, offset: int) -> None:
        """Index one record just written (lock held)."""
        self._replay(h.key, h.namespace_id, h.flags, seg_no, offset // BLOCK,
                     record_size(h.payload_len) // BLOCK)

    def _replay(self, key: bytes, namespace_id: bytes, flags: int, seg_no: int, block: int,
                blocks: int) -> None:
        """Apply one record to the index (recovery and live writes alike)."""
        if flags & FLAG_NS_TOMBSTONE:
            idx = self._ns.find(namespace_id)
            if idx >= 0:
                self._index.remove_slots(self._index.slots_where(ns_index=idx), cleared_ns=idx)
        elif flags & FLAG_TOMBSTONE:
            self._index.remove(key)
        else:
            self._index.put(key, seg_no, block, blocks, self._ns.number(namespace_id))

    # ------------------------------------------------------------------ writes
    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("SSD engine is closed")

    def put(self, key: bytes, ns: Namespace, data: Any) -> bool:
        """Append one chunk. Returns True once written (and synced in durable mode)."""
        return self.put_many([(key, ns, data)]) == 1

    def put_many(self, items: Iterable[tuple[bytes, Namespace, Any]], *,
                 reserved: Callable[[], object] | None = None) -> int:
        """Append chunks in as few large writes as possible. Returns how many were written.

        The records take their place at the log head (in the order given) before their
        payloads are hashed: ``reserved``, when given, is called once the last of them has
        its place (outside the engine lock; not called if put_many raises before that), so a
        caller that runs several put_many at once (the write-behind queue's writers) keeps
        its batches in the log in the order it took them while one batch is hashed and
        another written. (A batch that crosses a segment end is placed in two parts, the
        second after the first is written: the next batch waits for that.)

        Raises ValueError for a key that is not 16 bytes, a payload larger than a segment or a
        non-contiguous buffer; PoolClosedError after close. An IO error while writing raises
        OSError: the records of the failed write are not indexed (those of a batch's earlier
        part in another segment, already written, are).
        """
        self._check_open()
        pending = []
        for key, ns, data in items:
            if len(key) != KEY_BYTES:
                raise ValueError(f"chunk key must be {KEY_BYTES} bytes, got {len(key)}")
            view = byte_view(data, writable=False)
            if view.nbytes > self.max_payload:
                raise ValueError(f"chunk of {view.nbytes} bytes does not fit ssd.segment_size="
                                 f"{self.segment_size}")
            # checksum 0 for now: hashed once placed (_append_batches), before it is written
            header = RecordHeader(bytes(key), ns.id, ns.layout_id, view.nbytes, 0, 0)
            pending.append(Pending(header, view, -1, hashed=False))
        with self._lock:
            for p in pending:
                p.ns_index = self._ns.number(p.header.namespace_id)
        self._append(pending, reserved)
        self._counters.add("puts", len(pending))
        self._counters.add_many({
            "put_bytes": sum(p.payload.nbytes for p in pending),
            # what the log holds for them: a header block each, payloads padded to blocks
            "log_bytes": sum(record_size(p.payload.nbytes) for p in pending)})
        return len(pending)

    def _append(self, pending: list[Pending],
                reserved: Callable[[], object] | None = None) -> None:
        if self.durability == "durable":
            with self._durable_lock:
                self._append_batches(pending, reserved)
        else:
            self._append_batches(pending, reserved)

    def _append_batches(self, pending: list[Pending],
                        reserved: Callable[[], object] | None = None) -> None:
        start = 0
        while start < len(pending):
            with self._lock:
                self._check_open()
                n = self._log.reserve(pending, start)
            if reserved is not None and start + n == len(pending):
                reserved()  # every record placed: the caller's next batch may follow
            batch = pending[start:start + n]
            seg_no = batch[0].segment
            written = False
            try:
                hash_payloads(batch)  # outside the lock, the records' places already taken
                write_batch(self._store, self._tls, batch)
                if self.durability == "durable":
                    self._store.sync(seg_no)
                written = True
            finally:
                with self._lock:
                    # Index before dropping inflight: once inflight is 0 the segment may be
                    # recycled, and entries added after that would point into its next life.
                    if written:
                        for p in batch:
                            self._apply(p.header, p.segment, p.offset)
                    self._log.release(seg_no, () if written else batch)
            start += n

    def _append_marker(self, header: RecordHeader) -> None:
        with self._lock:
            ns_index = self._ns.number(header.namespace_id)
        self._append([Pending(header, memoryview(b""), ns_index)])

    def delete(self, key: bytes) -> bool:
        """Remove a chunk; a tombstone keeps it deleted across restarts. False if absent."""
        self._check_open()
        with self._lock:
            loc = self._index.get(key)
            if loc is None:
                return False
            ns_id = self._ns.id_of(loc.ns_index)
        self._append_marker(RecordHeader(bytes(key), ns_id, 0, 0, 0, 0, FLAG_TOMBSTONE))
        self._counters.add("deletes")
        return True

    def invalidate(self, namespace_id: bytes) -> int:
        """Drop every chunk of a namespace (persisted by a namespace tombstone). Returns how
        many were dropped."""
        self._check_open()
        with self._lock:
            idx = self._ns.find(namespace_id)
            if idx < 0:
                return 0
            count = int(self._index.slots_where(ns_index=idx).size)
        self._append_marker(RecordHeader(bytes(KEY_BYTES), namespace_id, 0, 0, 0, 0,
                                         FLAG_NS_TOMBSTONE))
        return count

    def attach_events(self, events: TierEvents | None) -> None:
        """Tell ``events`` of every record indexed or dropped from now on (KV events,
        docs/routing.md); None detaches. What the index already holds is not announced."""
        with self._lock:
            self._index.observer = None if events is None else _IndexEvents(events,
                                                                           self._ns.id_of)

    # ------------------------------------------------------------------ reads
    def contains(self, key: bytes, namespace_id: bytes | None = None) -> bool:
        """True if the key is indexed (under ``namespace_id``, when given)."""
        self._check_open()
        with self._lock:
            if namespace_id is None:
                return key in self._index
            ns_index = self._index.ns_index_of(key)
            return ns_index >= 0 and self._ns.id_of(ns_index) == namespace_id

    def contains_many(self, keys: Sequence[bytes], namespace_id: bytes) -> list[bool]:
        """``contains`` for a batch, under one lock acquisition."""
        self._check_open()
        with self._lock:
            want = self._ns.find(namespace_id)
            ns_index_of = self._index.ns_index_of
            return [want >= 0 and ns_index_of(k) == want for k in keys]

    def get_into(self, key: bytes, out: Any, *, namespace_id: bytes | None = None) -> bool:
        """Read a chunk's payload into ``out`` (exactly the payload size). Returns False on a
        miss, including a record that fails verification (counted, dropped). On a miss the
        contents of ``out`` are unspecified. With ``namespace_id``, a record stored under
        another namespace is a miss too (counted as ``namespace_mismatch``; the record stays:
        it is valid for its own namespace), checked before the size. Raises ChunkSizeError if
        ``out`` has the wrong size, PoolClosedError after close."""
        self._check_open()
        view = byte_view(out, writable=True)
        with self._lock:
            loc = self._index.get(key, mark_hot=True)
        return (self._checks.admit(loc, view, namespace_id) and loc is not None
                and self._checks.fetch(key, loc, view, True, namespace_id))

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any], *,
                      namespace_id: bytes | None = None) -> list[bool]:
        """Reads on the IO thread pool; same contract as get_into per key (a wrong-sized
        ``out`` raises before any read). Keys whose records lie back to back in one segment,
        in the order given (a prefix saved by one put_many), are read as one run: one preadv
        of up to ``ssd.coalesce_max_bytes`` (reader.plan_runs). Every record of a run passes
        the checks alone: a bad one is a counted miss that costs no neighbour, and a run whose
        read fails is read again record by record."""
        self._check_open()
        if len(keys) != len(outs):
            raise ValueError("keys and outs differ in length")
        views = [byte_view(o, writable=True) for o in outs]
        with self._lock:
            locs = self._index.get_many(keys, mark_hot=True)
        wanted = self._checks.admit_many(locs, views, namespace_id)
        hits = [False] * len(keys)

        def read(run: list[int]) -> None:
            got = self._checks.fetch_run([keys[i] for i in run], [found[i] for i in run],
                                         [views[i] for i in run], namespace_id)
            for i, ok in zip(run, got, strict=True):
                hits[i] = ok

        found = cast(list[Location], locs)  # every wanted one is located (admit)
        runs = plan_runs(wanted, found, self._coalesce_max)
        if len(runs) == 1:
            read(runs[0])
        else:
            list(self._io.map(read, runs))
        return hits

    def newest(self, namespace_id: bytes, max_bytes: int) -> list[bytes]:
        """The keys of the namespace's most recently written records whose payloads fit
        ``max_bytes`` in all, in write order (oldest of them first, so a prefix saved by one
        put_many stays one run for get_many_into); what a restart warms DRAM with. Empty for
        a namespace with no records; never raises once open.

        Only the snapshot of the namespace's index columns is taken under the engine lock
        (a vectorised scan and copy: milliseconds for a million records); the sort (~0.8 s
        per million) runs outside it, so readers and writers never wait for it. A record
        evicted or deleted meanwhile may still be listed: reading it is a miss."""
        self._check_open()
        with self._lock:
            want = self._ns.find(namespace_id)
            if want < 0 or max_bytes <= 0:
                return []
            slots = self._index.slots_where(ns_index=want)
            if not slots.size:
                return []
            start = np.array([self._log.segments[s].start_seq for s in range(self._store.count)],
                             dtype=np.uint64)
            column = self._index.column
            # fancy indexing copies: the snapshot stays valid after the lock is released
            seq = start[column("segment")[slots]]
            block, blocks = column("block")[slots], column("blocks")[slots]
            keys = np.empty((slots.size, 2), dtype="<u8")
            keys[:, 0], keys[:, 1] = column("k0")[slots], column("k1")[slots]
        # newest first: by the segment's first seq, then by place in the segment
        order = np.lexsort((block, seq))[::-1]
        payload = (blocks[order].astype(np.int64) - 1) * BLOCK
        taken = int(np.searchsorted(np.cumsum(payload), max_bytes, side="right"))
        raw = keys[order[:taken][::-1]].tobytes()
        return split_key_bytes(raw)

    # ------------------------------------------------------------------ admin
    def stats(self) -> dict[str, Any]:
        with self._lock:
            used = self._log.used_bytes()
            out: dict[str, Any] = self._counters.snapshot()
            out.update(records=len(self._index), used_bytes=used,
                       capacity_bytes=self._store.count * self.segment_size,
                       segments=self._store.count, free_segments=len(self._log.free),
                       index_bytes=self._index.nbytes(), direct_io=self._store.direct,
                       durability=self.durability, marks_queued=len(self._marks),
                       marks_dropped=self._marks.dropped)
        return out

    def close(self) -> None:
        """Wait for in-flight IO, then release files. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._log.close()
            self._log.wait_idle()  # in-flight writes and a roll's IO: fds stay open for them
        self._io.shutdown(wait=True)
        self._pieces.shutdown(wait=True)
        self._store.close()

    def touch(self, key: bytes) -> bool:
        """Mark a chunk as read (copied forward by second_chance eviction) without reading
        it. Never waits: False if absent or closed; while another thread holds the engine's
        lock the mark is queued instead (``note_reads``; counted as touch_deferred) and
        False returned, since whether the key is indexed is then not known."""
        if self._closed:
            return False
        if not self._lock.acquire(blocking=False):
            self._counters.add("touch_deferred")
            self.note_reads([key])
            return False
        try:
            return self._index.get(key, mark_hot=True) is not None
        finally:
            self._lock.release()

    def note_reads(self, keys: Sequence[bytes]) -> None:
        """Count reads of ``keys`` served above the SSD (DRAM hits, a replica's TOUCH) so
        second_chance eviction copies their records forward like records read here. Costs
        the caller a lock-free append (ssd/recency.py); every ``ReadMarks.batch`` keys the
        caller applies a batch to the index if the lock is free at once (it never waits),
        and a segment roll applies every queued mark before it picks its victim. Keys not
        indexed (or of another namespace) are ignored; never raises, a no-op once closed."""
        if keys and not self._closed and self._marks.add(keys) \
                and self._lock.acquire(blocking=False):
            try:
                self._apply_marks(self._marks.batch)
            finally:
                self._lock.release()

    def take_hot_dropped(self) -> list[bytes]:
        """The keys of records read since written that segment eviction dropped because
        they did not fit ``ssd.copy_forward_fraction`` (counted as hot_dropped), since the
        last call, oldest first (at most the last ``log.HOT_DROPPED_KEYS``): what the pool
        writes back from DRAM. Cheap when there are none (no lock); never raises."""
        keys = self._log.hot_dropped_keys
        if not keys:
            return []
        with self._lock:
            taken = list(keys)
            keys.clear()
        return taken

    def _apply_marks(self, max_keys: int | None) -> None:
        """Mark up to ``max_keys`` queued reads hot in the index (all: None). Lock held."""
        keys = self._marks.take(max_keys)
        if keys:
            self._counters.add("marked_reads", self._index.mark_hot_many(keys))


class _IndexEvents:
    """The index's observer: its namespace numbers turned into namespace ids."""

    __slots__ = ("_events", "_id_of")

    def __init__(self, events: TierEvents, id_of: Callable[[int], bytes]) -> None:
        self._events, self._id_of = events, id_of

    def added(self, key: bytes, ns_index: int) -> None:
        self._events.stored((key,), self._id_of(ns_index))

    def removed(self, keys: list[bytes], ns_indexes: list[int]) -> None:
        by_ns: dict[int, list[bytes]] = {}
        for key, idx in zip(keys, ns_indexes, strict=True):
            by_ns.setdefault(idx, []).append(key)
        for idx, group in by_ns.items():
            self._events.removed(group, self._id_of(idx))

    def cleared(self, ns_index: int) -> None:
        self._events.cleared(self._id_of(ns_index))
