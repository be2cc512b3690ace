"""The checks that make an SSD read a hit or a counted miss (engine.py's read path): a read
is admitted (indexed, under the asked namespace, into a buffer of the record's size), read
(reader.py: one record, or a run of back-to-back ones), then its header and payload checked
(key, namespace, length, payload checksum). A record that fails is dropped from the index,
counted (``checksum_failures``) and logged (event ``checksum_failure``, rate-limited); an IO
error is counted (``io_errors``) and keeps the record.

Thread-safe: called from the caller's thread and the engine's IO threads at once; the
counters are thread-safe and the index is touched only under the engine lock it is given.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Executor
from contextlib import closing

from kvpool.counters import Counters
from kvpool.errors import ChunkSizeError, CorruptRecordError
from kvpool.logs import RateLimited
from kvpool.record import BLOCK, HEADER_BLOCK, describes, record_size
from kvpool.ssd.directio import ThreadBuffers
from kvpool.ssd.index import CompactIndex, Location, NamespaceIds
from kvpool.ssd.reader import RecordRead, checked, read_record, read_run
from kvpool.ssd.segments import SegmentStore

log = logging.getLogger("kvpool.ssd")

#: Bytes of a key a log line shows (in hex): enough to tell records apart, not the address.
KEY_PREFIX_BYTES = 4


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
        self._say_corrupt = RateLimited()

    def admit(self, loc: Location | None, out: memoryview, namespace_id: bytes | None) -> bool:
        """Count a get; False (a counted miss) when the key is not indexed (``loc`` None) or
        is indexed under another namespace. Raises ChunkSizeError when ``out`` does not fit
        the record."""
        return bool(self.admit_many((loc,), (out,), namespace_id))

    def admit_many(self, locs: Sequence[Location | None], outs: Sequence[memoryview],
                   namespace_id: bytes | None) -> list[int]:
        """``admit`` for a batch, counted once for the batch rather than once per key: the
        indices of the keys to read. Raises ChunkSizeError as ``admit`` does (the keys up to
        that one counted as gets)."""
        # The index knows each record's namespace: a foreign one costs no IO (and is not a
        # ChunkSizeError when the other namespace's chunks differ in size). A namespace's
        # number is never reused, so comparing numbers is comparing ids.
        check_ns = namespace_id is not None
        want = self._ns.find(namespace_id) if namespace_id is not None else -1
        wanted: list[int] = []
        seen = absent = foreign = 0
        try:
            for i, loc in enumerate(locs):
                seen = i + 1
                if loc is None:
                    absent += 1
                elif check_ns and loc.ns_index != want:
                    foreign += 1
                elif record_size(outs[i].nbytes) != loc.blocks * BLOCK:
                    raise ChunkSizeError(f"output buffer of {outs[i].nbytes} bytes does not "
                                         f"match the stored record of {loc.blocks * BLOCK} "
                                         "bytes")
                else:
                    wanted.append(i)
        finally:
            self._counters.add("gets", seen)
            if absent or foreign:
                self._counters.add("misses", absent + foreign)
            if foreign:
                self._counters.add("namespace_mismatch", foreign)
        return wanted

    def fetch_run(self, keys: list[bytes], locs: list[Location], outs: list[memoryview],
                  namespace_id: bytes | None) -> list[bool]:
        """Read admitted records lying back to back (reader.read_run), checking each alone
        as it lands. The common record passes a lean check (record.describes: one unpack,
        two hashes); one that fails it is judged again by the full checks (verdict /
        corrupt), which count and log why. A record the read did not reach, and every record
        not yet checked when the run's read failed, is read alone (fetch), so a bad sector
        costs only the records on it."""
        if len(keys) == 1:
            return [self.fetch(keys[0], locs[0], outs[0], False, namespace_id)]
        hits: list[bool] = []
        passed = 0  # hits of the lean check, counted once for the run
        try:
            with closing(read_run(self._store, self._buffers, self._pieces, locs, outs,
                                  self._piece)) as landed:
                for scratch, place in landed:
                    j = len(hits)
                    key, loc, out = keys[j], locs[j], outs[j]
                    if place is None:
                        hits.append(self.fetch(key, loc, out, False, namespace_id))
                        continue
                    header_at, payload = place
                    if describes(scratch, header_at, key, namespace_id, payload):
                        if payload is not out:
                            out[:] = payload
                        passed += 1
                        hits.append(True)
                    else:
                        read = checked(scratch, header_at, payload, loc.blocks * BLOCK)
                        hits.append(self._judge(key, loc, out, read, namespace_id))
            self._counters.add("coalesced_reads")
            self._counters.add("coalesced_records", len(keys))
        except OSError as exc:  # maybe one bad sector: read each alone, each counts its own
            log.debug("ssd: coalesced read failed (%s); reading its records one by one", exc)
            hits.extend(self.fetch(keys[j], locs[j], outs[j], False, namespace_id)
                        for j in range(len(hits), len(keys)))
        if passed:
            self._counters.add("hits", passed)
        return hits

    def _judge(self, key: bytes, loc: Location, out: memoryview,
               read: RecordRead | CorruptRecordError, namespace_id: bytes | None) -> bool:
        """The full checks of one record of a run as read; a hit is counted here."""
        if isinstance(read, CorruptRecordError):
            return self.corrupt(key, loc, str(read))
        if self.verdict(key, loc, out, read, namespace_id):
            self._counters.add("hits")
            return True
        return False

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
        if self.verdict(key, loc, out, read, namespace_id):
            self._counters.add("hits")
            return True
        return False

    def verdict(self, key: bytes, loc: Location, out: memoryview, read: RecordRead,
                 namespace_id: bytes | None) -> bool:
        """The checks that make a record just read a hit (its payload then in ``out``); a
        failure is counted here, a hit by the caller (once per run)."""
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
        return True

    def miss(self) -> bool:
        self._counters.add("misses")
        return False

    def wrong_namespace(self) -> bool:
        self._counters.add("namespace_mismatch")
        return self.miss()

    def corrupt(self, key: bytes, loc: Location, why: str) -> bool:
        """Count, log (event checksum_failure, at most one line per LOG_INTERVAL_S with the
        number held back; the key as a short hex prefix), drop the record, miss."""
        self._counters.add("checksum_failures")
        held = self._say_corrupt.due()
        if held is not None:
            prefix, offset = key[:KEY_PREFIX_BYTES].hex(), loc.block * BLOCK
            log.warning("ssd: corrupt record %s... in segment %d at offset %d (%s); dropped and "
                        "served as a miss%s", prefix, loc.segment, offset, why,
                        f" ({held} more since the last report)" if held else "",
                        extra={"event": "checksum_failure", "segment": loc.segment,
                               "offset": offset, "key_prefix": prefix, "reason": why,
                               "held_back": held})
        with self._lock:
            if self._index.get(key) == loc:
                self._index.remove(key)
        return self.miss()
