"""The checks that make an SSD read a hit or a counted miss (engine.py's read path): a read
is admitted (indexed, under the asked namespace, into a buffer of the record's size), read
(reader.py: one record, or a run of back-to-back ones), then its header and payload checked
(key, namespace, length, payload checksum). A record that fails is dropped from the index and
counted (``checksum_failures``); an IO error is counted (``io_errors``) and keeps the record.

Thread-safe: called from the caller's thread and the engine's IO threads at once; the
counters are thread-safe and the index is touched only under the engine lock it is given.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Executor

from kvpool.counters import Counters
from kvpool.errors import ChunkSizeError, CorruptRecordError
from kvpool.record import BLOCK, HEADER_BLOCK, record_size
from kvpool.ssd.directio import ThreadBuffers
from kvpool.ssd.index import CompactIndex, Location, NamespaceIds
from kvpool.ssd.reader import RecordRead, read_record, read_run
from kvpool.ssd.segments import SegmentStore

log = logging.getLogger("kvpool.ssd")


class ReadChecks:
    """The engine's read path below the lookup; shares the engine's store, buffers, piece
    pool, counters, lock, index and namespace table. Misuse raises (ChunkSizeError); every
    failure of the medium or the record is a counted miss, never an exception."""

    def __init__(self, store: SegmentStore, buffers: ThreadBuffers, pieces: Executor,
                 counters: Counters, lock: threading.Lock, index: CompactIndex,
                 ns: NamespaceIds, pipeline_min: int, piece: int) -> None:
        self._store, self._buffers, self._pieces = store, buffers, pieces
        self._counters, self._lock, self._index, self._ns = counters, lock, index, ns
        self._pipeline_min, self._piece = pipeline_min, piece

    def admit(self, key: bytes, loc: Location | None, out: memoryview,
               namespace_id: bytes | None) -> bool:
        """Count a get; False (a counted miss) when ``key`` is not indexed or is indexed under
        another namespace. Raises ChunkSizeError when ``out`` does not fit the record."""
        self._counters.add("gets")
        if loc is None:
            return self.miss()
        # The index knows each record's namespace: a foreign one costs no IO (and is not a
        # ChunkSizeError when the other namespace's chunks differ in size).
        if namespace_id is not None and self._ns.id_of(loc.ns_index) != namespace_id:
            return self.wrong_namespace()
        if record_size(out.nbytes) != loc.blocks * BLOCK:
            raise ChunkSizeError(f"output buffer of {out.nbytes} bytes does not match the "
                                 f"stored record of {loc.blocks * BLOCK} bytes")
        return True

    def fetch_run(self, keys: list[bytes], locs: list[Location], outs: list[memoryview],
                   namespace_id: bytes | None) -> list[bool]:
        """Read admitted records lying back to back: one preadv, then each record checked."""
        if len(keys) == 1:
            return [self.fetch(keys[0], locs[0], outs[0], False, namespace_id)]
        reads: list[RecordRead | CorruptRecordError | None]
        try:
            reads = read_run(self._store, self._buffers, self._pieces, locs, outs, self._piece)
            self._counters.add("coalesced_reads")
            self._counters.add("coalesced_records", len(keys))
        except OSError as exc:  # maybe one bad sector: read each alone, each counts its own
            log.debug("ssd: coalesced read failed (%s); reading its records one by one", exc)
            reads = [None] * len(keys)
        hits = []
        for key, loc, out, r in zip(keys, locs, outs, reads, strict=True):
            if r is None:  # not reached by a short read, or the run failed
                hits.append(self.fetch(key, loc, out, False, namespace_id))
            elif isinstance(r, CorruptRecordError):
                hits.append(self.corrupt(key, loc, str(r)))
            else:
                hits.append(self.verdict(key, loc, out, r, namespace_id))
        return hits

    def fetch(self, key: bytes, loc: Location, out: memoryview, pipelined: bool,
               namespace_id: bytes | None) -> bool:
        """Read one admitted record into ``out``; True for a hit, else a counted miss."""
        try:
            read = read_record(self._store, self._buffers, self._pieces, loc, out,
                               self._pipeline_min if pipelined else None, self._piece)
        except OSError as exc:
            self._counters.add("io_errors")
            log.warning("ssd: read error %s; served as a miss", exc)
            return self.miss()
        except CorruptRecordError as exc:
            return self.corrupt(key, loc, str(exc))
        return self.verdict(key, loc, out, read, namespace_id)

    def verdict(self, key: bytes, loc: Location, out: memoryview, read: RecordRead,
                 namespace_id: bytes | None) -> bool:
        """The checks that make a record just read a hit (its payload then in ``out``)."""
        h, got, nbytes = read.header, read.got, out.nbytes
        if h.key != key:  # the segment was recycled under us: the record is simply gone
            self._counters.add("stale_reads")
            return self.miss()
        if namespace_id is not None and h.namespace_id != namespace_id:
            return self.wrong_namespace()  # re-put under another namespace since located
        if got < HEADER_BLOCK + nbytes or h.payload_len != nbytes or h.is_tombstone:
            return self.corrupt(key, loc, "length mismatch")
        if read.digest != h.checksum:
            return self.corrupt(key, loc, "payload checksum mismatch")
        if read.payload is not out:
            out[:] = read.payload[:nbytes]
        self._counters.add("hits")
        return True

    def miss(self) -> bool:
        self._counters.add("misses")
        return False

    def wrong_namespace(self) -> bool:
        self._counters.add("namespace_mismatch")
        return self.miss()

    def corrupt(self, key: bytes, loc: Location, why: str) -> bool:
        self._counters.add("checksum_failures")
        log.warning("ssd: corrupt record %s (%s); dropped and served as a miss", key.hex(), why)
        with self._lock:
            if self._index.get(key) == loc:
                self._index.remove(key)
        return self.miss()
