"""The SSD tier: a log-structured engine of large preallocated segments (DESIGN.md section 4).

Records (record.py) are appended at the head of the active segment with O_DIRECT; an in-memory
CompactIndex maps key -> (segment, block, blocks). On start the index is rebuilt by scanning
the self-describing records of every segment in sequence order (tombstones replayed, a torn
tail discarded). When the log is full the oldest segment is freed whole; the segment policy
may copy its recently read records forward first.

Failure contract: a read never returns bytes that fail the header or payload checksum, the key
check or the length check; such reads are counted misses. IO errors on reads are counted
misses. Misuse (wrong buffer size, closed engine) raises. In ``durable`` mode a put returns
only after fdatasync; in ``cache`` mode a crash may lose recent records but never corrupts.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import xxhash

from kvpool.buffers import byte_view
from kvpool.errors import ChunkSizeError, CorruptRecordError, PoolClosedError
from kvpool.keys import KEY_BYTES, Namespace
from kvpool.policy import make_segment_policy
from kvpool.record import (
    BLOCK,
    FLAG_NS_TOMBSTONE,
    FLAG_TOMBSTONE,
    HEADER_BLOCK,
    HEADER_SIZE,
    RecordHeader,
    payload_checksum,
    record_size,
    round_up,
    unpack_header,
)
from kvpool.ssd.directio import DirectMode, aligned_buffer, is_direct_capable
from kvpool.ssd.index import CompactIndex, Location
from kvpool.ssd.recovery import scan_media
from kvpool.ssd.segments import SegmentHeader, SegmentStore

log = logging.getLogger("kvpool.ssd")

Durability = Literal["cache", "durable"]
EPOCH_SHIFT = 40  # seq = epoch << 40 | counter; every open starts a new epoch
MAX_IOV = 512
MAX_WRITE_BYTES = 64 << 20

# A single large get_into is read in pieces so the checksum overlaps the IO (batched reads
# already overlap one another on the IO pool and are not split).
PIPELINE_MIN_BYTES = 1 << 20
PIPELINE_PIECE_BYTES = 512 << 10
PIPELINE_THREADS = 2

_FREE, _ACTIVE, _SEALED = 0, 1, 2
_ZERO_HEADER_TAIL = bytes(HEADER_BLOCK - HEADER_SIZE)


@dataclass(slots=True)
class _Segment:
    state: int = _FREE
    start_seq: int = 0
    write_off: int = HEADER_BLOCK  # next free byte, relative to the segment base
    inflight: int = 0


@dataclass(slots=True)
class _Pending:
    """One record on its way to the log."""

    header: RecordHeader
    payload: memoryview  # empty for tombstones
    ns_index: int
    segment: int = -1
    offset: int = -1


class _ThreadBuffers(threading.local):
    """Per-thread aligned buffers, reused across calls: a fresh mmap per IO costs a syscall
    and first-touch page faults that are slower than the IO itself for small chunks."""

    def __init__(self) -> None:
        self.header = memoryview(aligned_buffer(BLOCK))
        self.staging = memoryview(aligned_buffer(BLOCK))
        self.write = memoryview(aligned_buffer(BLOCK))

    def staging_of(self, nbytes: int) -> memoryview:
        if len(self.staging) < nbytes:
            self.staging = memoryview(aligned_buffer(nbytes))
        return self.staging[:nbytes]

    def write_of(self, nbytes: int) -> memoryview:
        if len(self.write) < nbytes:
            self.write = memoryview(aligned_buffer(nbytes))
        return self.write[:nbytes]


class SsdEngine:
    """Log-structured SSD tier. Thread-safe; reads and writes from many threads run in
    parallel (writes serialise in ``durable`` mode so an acknowledged record never follows a
    hole in the log).

    Raises ValueError for bad geometry (segment size not a multiple of 4 KiB, fewer than two
    segments) and OSError if the media cannot be opened or preallocated (e.g. ENOSPC).
    """

    def __init__(self, path: str | os.PathLike[str], capacity: int,
                 segment_size: int = 256 << 20, durability: Durability = "cache",
                 io_threads: int = 4, direct_io: DirectMode = "auto",
                 eviction: str = "second_chance", copy_forward_fraction: float = 0.25) -> None:
        if segment_size % BLOCK or segment_size < 4 * BLOCK:
            raise ValueError(f"ssd.segment_size must be a multiple of {BLOCK} and at least "
                             f"{4 * BLOCK}, got {segment_size}")
        if durability not in ("cache", "durable"):
            raise ValueError(f"ssd.durability must be 'cache' or 'durable', got {durability!r}")
        self.durability: Durability = durability
        self._policy = make_segment_policy(eviction)
        self._forward_budget_blocks = int(copy_forward_fraction * segment_size) // BLOCK
        if capacity // segment_size > 0xFFFF:
            raise ValueError(f"ssd.capacity={capacity} is more than 65535 segments of "
                             f"ssd.segment_size={segment_size}; raise ssd.segment_size")
        self._store = SegmentStore(Path(path), capacity, segment_size, direct_io)
        self.segment_size = segment_size
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._durable_lock = threading.Lock()
        self._index = CompactIndex()
        self._ns_ids: list[bytes] = []
        self._ns_lookup: dict[bytes, int] = {}
        self._segments = [_Segment() for _ in range(self._store.count)]
        self._fifo: deque[int] = deque()  # sealed segments, oldest first
        self._free: list[int] = []
        self._active = -1
        self._rolling = False
        self._closed = False
        self._tls = _ThreadBuffers()
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="kvpool-ssd")
        self._pieces = ThreadPoolExecutor(PIPELINE_THREADS, thread_name_prefix="kvpool-ssd-piece")
        self._counters: dict[str, int] = dict.fromkeys(
            ("puts", "put_bytes", "gets", "hits", "misses", "checksum_failures", "stale_reads",
             "io_errors", "segments_evicted", "records_evicted", "copied_forward",
             "torn_discarded", "deletes"), 0)
        self._seq = self._recover()

    # ------------------------------------------------------------------ properties
    @property
    def direct_io(self) -> bool:
        return self._store.direct

    @property
    def max_payload(self) -> int:
        return self.segment_size - 2 * HEADER_BLOCK

    def __len__(self) -> int:
        return len(self._index)

    def index_bytes_per_chunk(self) -> float:
        with self._lock:
            return self._index.nbytes() / max(1, len(self._index))

    # ------------------------------------------------------------------ recovery
    def _read_block(self, segment: int, offset: int, out: memoryview) -> int:
        return os.preadv(self._store.fd(segment), [out], self._store.base(segment) + offset)

    def _recover(self) -> int:
        """Rebuild segments and index from the media; returns the first seq of this open
        (a new epoch, above every seq the media may hold)."""
        scan = scan_media(self._store)
        for seg_no, scanned in enumerate(scan.segments):
            if scanned is None:
                self._free.append(seg_no)
            else:
                seg = self._segments[seg_no]
                seg.state, seg.start_seq, seg.write_off = _SEALED, scanned.start_seq, scanned.end
        self._counters["torn_discarded"] += scan.torn_discarded
        for record in scan.records:
            self._apply(record.header, record.segment, record.offset)
        self._fifo.extend(sorted((i for i, s in enumerate(self._segments) if s.state == _SEALED),
                                 key=lambda i: self._segments[i].start_seq))
        if scan.records:
            log.info("ssd: recovered %d records in %d segments", len(self._index), len(self._fifo))
        return ((scan.max_seq >> EPOCH_SHIFT) + 1) << EPOCH_SHIFT

    def _ns_index(self, ns_id: bytes) -> int:
        idx = self._ns_lookup.get(ns_id)
        if idx is None:
            if len(self._ns_ids) >= 0xFFFF:
                raise ValueError("more than 65535 namespaces on one SSD engine")
            idx = len(self._ns_ids)
            self._ns_ids.append(ns_id)
            self._ns_lookup[ns_id] = idx
        return idx

    def _apply(self, h: RecordHeader, seg_no: int, offset: int) -> None:
        """Replay one record into the index (recovery and live writes alike)."""
        if h.flags & FLAG_NS_TOMBSTONE:
            idx = self._ns_lookup.get(h.namespace_id)
            if idx is not None:
                self._index.remove_slots(self._index.slots_where(ns_index=idx))
        elif h.flags & FLAG_TOMBSTONE:
            self._index.remove(h.key)
        else:
            self._index.put(h.key, seg_no, offset // BLOCK, record_size(h.payload_len) // BLOCK,
                            self._ns_index(h.namespace_id))

    # ------------------------------------------------------------------ log head
    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("SSD engine is closed")

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _roll(self) -> None:
        """Seal the active segment and open a fresh one, evicting the oldest if none is free.
        Called with the lock held; may wait (releasing it) for writes into the victim."""
        self._rolling = True
        try:
            if self._active >= 0:
                self._segments[self._active].state = _SEALED
                self._fifo.append(self._active)
                self._active = -1
            forward: list[tuple[bytes, int, memoryview]] = []
            if not self._free:
                forward = self._evict_oldest()
            seg_no = self._free.pop()
            seg = self._segments[seg_no]
            seg.state, seg.start_seq, seg.write_off = _ACTIVE, self._next_seq(), HEADER_BLOCK
            header = SegmentHeader(self.segment_size, seg_no, seg.start_seq).pack()
            os.pwritev(self._store.fd(seg_no), [header], self._store.base(seg_no))
            if self.durability == "durable":
                self._store.sync(seg_no)
            self._active = seg_no
            self._write_forward(forward)
        finally:
            self._rolling = False
            self._cond.notify_all()

    def _evict_oldest(self) -> list[tuple[bytes, int, memoryview]]:
        victim = self._fifo.popleft()
        while self._segments[victim].inflight:
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
                if h.key == key and payload_checksum(
                        buf[HEADER_BLOCK:HEADER_BLOCK + h.payload_len]) == h.checksum:
                    forward.append((key, int(ns_col[slot]), buf))
            except (OSError, CorruptRecordError):
                self._counters["checksum_failures"] += 1
        self._index.remove_slots(slots)
        self._counters["segments_evicted"] += 1
        self._counters["records_evicted"] += int(slots.size) - len(forward)
        self._segments[victim] = _Segment()
        self._free.append(victim)
        return forward

    def _write_forward(self, forward: list[tuple[bytes, int, memoryview]]) -> None:
        """Rewrite copied-forward records (already verified) at the head with new seqs."""
        seg_no = self._active
        seg = self._segments[seg_no]
        for key, ns_index, buf in forward:
            old = unpack_header(buf)
            new = RecordHeader(key, old.namespace_id, old.layout_id, old.payload_len,
                               self._next_seq(), old.checksum, old.flags)
            new.pack_into(buf)
            offset = seg.write_off
            os.pwritev(self._store.fd(seg_no), [buf], self._store.base(seg_no) + offset)
            seg.write_off += len(buf)
            self._index.put(key, seg_no, offset // BLOCK, len(buf) // BLOCK, ns_index)
            self._counters["copied_forward"] += 1
        if forward and self.durability == "durable":
            self._store.sync(seg_no)

    def _reserve_batch(self, pending: list[_Pending], start: int) -> int:
        """Place records from ``pending[start:]`` into the active segment (rolling first if
        the next one does not fit). Returns how many were placed; lock held."""
        while self._rolling:
            self._cond.wait()
        size = record_size(pending[start].payload.nbytes)
        if self._active < 0 or self._segments[self._active].write_off + size > self.segment_size:
            self._roll()
        seg = self._segments[self._active]
        placed = 0
        for p in pending[start:]:
            size = record_size(p.payload.nbytes)
            if seg.write_off + size > self.segment_size:
                break
            p.segment, p.offset = self._active, seg.write_off
            p.header = RecordHeader(p.header.key, p.header.namespace_id, p.header.layout_id,
                                    p.header.payload_len, self._next_seq(), p.header.checksum,
                                    p.header.flags)
            seg.write_off += size
            placed += 1
        seg.inflight += 1
        return placed

    # ------------------------------------------------------------------ writes
    def put(self, key: bytes, ns: Namespace, data: Any) -> bool:
        """Append one chunk. Returns True once written (and synced in durable mode)."""
        return self.put_many([(key, ns, data)]) == 1

    def put_many(self, items: Iterable[tuple[bytes, Namespace, Any]]) -> int:
        """Append chunks in as few large writes as possible. Returns how many were written.

        Raises ValueError for a key that is not 16 bytes, a payload larger than a segment or a
        non-contiguous buffer; PoolClosedError after close. An IO error while writing raises
        OSError (nothing of that batch is indexed).
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
            header = RecordHeader(bytes(key), ns.id, ns.layout_id, view.nbytes, 0,
                                  payload_checksum(view))
            pending.append(_Pending(header, view, -1))
        with self._lock:
            for p in pending:
                p.ns_index = self._ns_index(p.header.namespace_id)
        self._append(pending)
        self._counters["puts"] += len(pending)
        self._counters["put_bytes"] += sum(p.payload.nbytes for p in pending)
        return len(pending)

    def _append(self, pending: list[_Pending]) -> None:
        if self.durability == "durable":
            with self._durable_lock:
                self._append_batches(pending)
        else:
            self._append_batches(pending)

    def _append_batches(self, pending: list[_Pending]) -> None:
        start = 0
        while start < len(pending):
            with self._lock:
                self._check_open()
                n = self._reserve_batch(pending, start)
            batch = pending[start:start + n]
            seg_no = batch[0].segment
            written = False
            try:
                self._write_batch(batch)
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
                    self._segments[seg_no].inflight -= 1
                    self._cond.notify_all()
            start += n

    def _write_batch(self, batch: list[_Pending]) -> None:
        """pwritev consecutive records: header blocks and unaligned payloads from this
        thread's staging buffer, aligned payloads (DRAM slots) straight from their memory."""
        direct = self._store.direct
        copied = [not (direct and is_direct_capable(p.payload)) for p in batch]
        copy_bytes = sum(round_up(p.payload.nbytes) for p, c in zip(batch, copied, strict=True)
                         if c)
        staging = self._tls.write_of(len(batch) * BLOCK + copy_bytes)
        pos = len(batch) * BLOCK
        iov: list[memoryview] = []
        iov_bytes = 0
        first = batch[0]
        fd, base = self._store.fd(first.segment), self._store.base(first.segment)
        offset = first.offset
        for i, (p, copy) in enumerate(zip(batch, copied, strict=True)):
            hblock = staging[i * BLOCK:(i + 1) * BLOCK]
            p.header.pack_into(hblock)
            hblock[HEADER_SIZE:] = _ZERO_HEADER_TAIL  # staging is reused: no stale bytes
            parts = [hblock]
            if p.payload.nbytes:
                padded = round_up(p.payload.nbytes)
                if copy:
                    dst = staging[pos:pos + padded]
                    dst[:p.payload.nbytes] = p.payload
                    dst[p.payload.nbytes:] = bytes(padded - p.payload.nbytes)
                    pos += padded
                    parts.append(dst)
                else:
                    parts.append(p.payload)
            if iov and (len(iov) + len(parts) > MAX_IOV or iov_bytes > MAX_WRITE_BYTES):
                self._pwritev_all(fd, iov, base + offset)
                offset += iov_bytes
                iov, iov_bytes = [], 0
            iov.extend(parts)
            iov_bytes += sum(len(v) for v in parts)
        if iov:
            self._pwritev_all(fd, iov, base + offset)

    @staticmethod
    def _pwritev_all(fd: int, iov: list[memoryview], offset: int) -> None:
        total = sum(len(v) for v in iov)
        written = os.pwritev(fd, iov, offset)
        if written != total:  # short writes are rare; finish byte-exactly with one copy
            flat = memoryview(aligned_buffer(total))
            pos = 0
            for v in iov:
                flat[pos:pos + len(v)] = v
                pos += len(v)
            while written < total:
                written += os.pwrite(fd, flat[written:], offset + written)

    def _append_marker(self, header: RecordHeader) -> None:
        with self._lock:
            ns_index = self._ns_index(header.namespace_id)
        self._append([_Pending(header, memoryview(b""), ns_index)])

    def delete(self, key: bytes) -> bool:
        """Remove a chunk; a tombstone keeps it deleted across restarts. False if absent."""
        self._check_open()
        with self._lock:
            loc = self._index.get(key)
            if loc is None:
                return False
            ns_id = self._ns_ids[loc.ns_index]
        self._append_marker(RecordHeader(bytes(key), ns_id, 0, 0, 0, 0, FLAG_TOMBSTONE))
        self._counters["deletes"] += 1
        return True

    def invalidate(self, namespace_id: bytes) -> int:
        """Drop every chunk of a namespace (persisted by a namespace tombstone). Returns how
        many were dropped."""
        self._check_open()
        with self._lock:
            idx = self._ns_lookup.get(namespace_id)
            if idx is None:
                return 0
            count = int(self._index.slots_where(ns_index=idx).size)
        self._append_marker(RecordHeader(bytes(KEY_BYTES), namespace_id, 0, 0, 0, 0,
                                         FLAG_NS_TOMBSTONE))
        return count

    # ------------------------------------------------------------------ reads
    def contains(self, key: bytes) -> bool:
        self._check_open()
        with self._lock:
            return key in self._index

    def longest_prefix(self, keys: Sequence[bytes]) -> int:
        self._check_open()
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._index:
                    return i
        return len(keys)

    def _locate(self, key: bytes) -> Location | None:
        with self._lock:
            return self._index.get(key, mark_hot=True)

    def get_into(self, key: bytes, out: Any) -> bool:
        """Read a chunk's payload into ``out`` (exactly the payload size). Returns False on a
        miss, including a record that fails verification (counted, dropped). On a miss the
        contents of ``out`` are unspecified. Raises ChunkSizeError if ``out`` has the wrong
        size, PoolClosedError after close."""
        self._check_open()
        view = byte_view(out, writable=True)
        return self._read(key, self._locate(key), view, pipelined=True)

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[bool]:
        """Parallel reads on the IO thread pool; same contract as get_into per key."""
        self._check_open()
        if len(keys) != len(outs):
            raise ValueError("keys and outs differ in length")
        views = [byte_view(o, writable=True) for o in outs]
        locs = [self._locate(k) for k in keys]
        if len(keys) <= 1:
            return [self._read(k, loc, v) for k, loc, v in zip(keys, locs, views, strict=True)]
        return list(self._io.map(self._read, keys, locs, views))

    def _read(self, key: bytes, loc: Location | None, out: memoryview,
              pipelined: bool = False) -> bool:
        self._counters["gets"] += 1
        if loc is None:
            self._counters["misses"] += 1
            return False
        nbytes = out.nbytes
        if record_size(nbytes) != loc.blocks * BLOCK:
            raise ChunkSizeError(f"output buffer of {nbytes} bytes does not match the stored "
                                 f"record of {loc.blocks * BLOCK} bytes")
        fd, pos = self._store.fd(loc.segment), self._store.base(loc.segment) + loc.block * BLOCK
        hblock = self._tls.header
        direct_into_out = not self._store.direct or is_direct_capable(out)
        payload = out if direct_into_out else self._tls.staging_of(round_up(nbytes))
        # One thread reads header + first piece and hashes each piece as it lands while the
        # piece pool reads the rest: the checksum no longer waits for the whole IO.
        split = pipelined and direct_into_out and nbytes >= PIPELINE_MIN_BYTES
        first = PIPELINE_PIECE_BYTES if split else len(payload)
        rest = [(o, min(PIPELINE_PIECE_BYTES, nbytes - o))
                for o in range(first, nbytes, PIPELINE_PIECE_BYTES)] if split else []
        futures = [self._pieces.submit(os.preadv, fd, [payload[o:o + n]],
                                       pos + HEADER_BLOCK + o) for o, n in rest]
        try:
            got = os.preadv(fd, [hblock, payload[:first]], pos)
            h = unpack_header(hblock)
            hasher = xxhash.xxh3_64(payload[:min(first, nbytes)])
            for future, (o, n) in zip(futures, rest, strict=True):
                got += future.result()
                hasher.update(payload[o:o + n])
        except OSError as exc:
            self._counters["io_errors"] += 1
            log.warning("ssd: read error %s; served as a miss", exc)
            return self._miss()
        except CorruptRecordError as exc:
            return self._corrupt(key, loc, str(exc))
        finally:
            for future in futures:  # never leave a piece landing in `out` after we return
                future.exception()
        if h.key != key:  # the segment was recycled under us: the record is simply gone
            self._counters["stale_reads"] += 1
            return self._miss()
        if got < HEADER_BLOCK + nbytes or h.payload_len != nbytes or h.is_tombstone:
            return self._corrupt(key, loc, "length mismatch")
        if hasher.intdigest() != h.checksum:
            return self._corrupt(key, loc, "payload checksum mismatch")
        if payload is not out:
            out[:] = payload[:nbytes]
        self._counters["hits"] += 1
        return True

    def _miss(self) -> bool:
        self._counters["misses"] += 1
        return False

    def _corrupt(self, key: bytes, loc: Location, why: str) -> bool:
        self._counters["checksum_failures"] += 1
        log.warning("ssd: corrupt record %s (%s); dropped and served as a miss", key.hex(), why)
        with self._lock:
            if self._index.get(key) == loc:
                self._index.remove(key)
        return self._miss()

    # ------------------------------------------------------------------ admin
    def stats(self) -> dict[str, Any]:
        with self._lock:
            used = sum(s.write_off for s in self._segments if s.state != _FREE)
            out: dict[str, Any] = dict(self._counters)
            out.update(records=len(self._index), used_bytes=used,
                       capacity_bytes=self._store.count * self.segment_size,
                       segments=self._store.count, free_segments=len(self._free),
                       index_bytes=self._index.nbytes(), direct_io=self._store.direct,
                       durability=self.durability)
        return out

    def close(self) -> None:
        """Wait for in-flight IO, then release files. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while any(s.inflight for s in self._segments):
                self._cond.wait()
        self._io.shutdown(wait=True)
        self._pieces.shutdown(wait=True)
        self._store.close()
