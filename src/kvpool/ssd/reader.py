"""Reading records of the SSD log into callers' buffers: one record with its header and
payload in one preadv (a large payload in pieces whose checksum overlaps the IO), or a run of
records that lie back to back in one segment (a prefix saved in one put_many) with one preadv
for the whole run. The checks that make a read a hit or a miss (key, namespace, length,
checksum) stay in the engine's read path and run on every record of a run alone."""

from __future__ import annotations

import os
from collections.abc import Generator, Sequence
from concurrent.futures import Executor
from typing import NamedTuple

import xxhash

from kvpool.errors import CorruptRecordError
from kvpool.record import (
    BLOCK,
    HEADER_BLOCK,
    RecordHeader,
    payload_checksum,
    round_up,
    unpack_header,
)
from kvpool.ssd.directio import ThreadBuffers, is_direct_capable
from kvpool.ssd.index import Location
from kvpool.ssd.segments import SegmentStore
from kvpool.ssd.writer import MAX_IOV

#: Records in one coalesced read: each takes at most three iovecs (header, payload, padding)
#: and one preadv takes at most MAX_IOV (the kernel's IOV_MAX is 1024).
MAX_RUN_RECORDS = MAX_IOV // 3


class RecordRead(NamedTuple):
    header: RecordHeader
    got: int  # bytes read, header block included
    digest: int  # xxh3-64 of the payload as read
    payload: memoryview  # ``out``, or this thread's staging buffer when ``out`` cannot


def read_record(store: SegmentStore, buffers: ThreadBuffers, pieces: Executor,
                loc: Location, out: memoryview, pipeline_min: int | None,
                piece: int) -> RecordRead:
    """Read the record at ``loc``, its payload into ``out`` where O_DIRECT allows (else into
    this thread's staging buffer). A payload of ``pipeline_min`` bytes or more (None: never;
    ``ssd.read_pipeline_min_bytes``) is read in pieces of ``piece`` bytes on ``pieces`` while
    this thread hashes each as it lands (a single large get_into; batched reads already
    overlap one another on the IO pool and are not split). Raises OSError
    when a read fails and CorruptRecordError when the header fails its checks; no piece is
    still landing in ``out`` once it returns or raises."""
    nbytes = out.nbytes
    fd, pos = store.fd(loc.segment), store.base(loc.segment) + loc.block * BLOCK
    hblock = buffers.header
    direct_into_out = not store.direct or is_direct_capable(out)
    if not (pipeline_min is not None and direct_into_out and nbytes >= pipeline_min):
        # One preadv, then the checks (the common case of small chunks: kept lean).
        payload = out if direct_into_out else buffers.staging_of(round_up(nbytes))
        got = os.preadv(fd, [hblock, payload], pos)
        digest = payload_checksum(out if direct_into_out else payload[:nbytes])
        return RecordRead(unpack_header(hblock), got, digest, payload)
    # One thread reads header + first piece and hashes each piece as it lands while the
    # piece pool reads the rest: the checksum no longer waits for the whole IO.
    rest = [(o, min(piece, nbytes - o)) for o in range(piece, nbytes, piece)]
    futures = [pieces.submit(os.preadv, fd, [out[o:o + n]], pos + HEADER_BLOCK + o)
               for o, n in rest]
    try:
        got = os.preadv(fd, [hblock, out[:piece]], pos)
        header = unpack_header(hblock)
        hasher = xxhash.xxh3_64(out[:piece])
        for future, (o, n) in zip(futures, rest, strict=True):
            got += future.result()
            hasher.update(out[o:o + n])
    finally:
        for future in futures:  # never leave a piece landing in `out` after we return
            future.exception()
    return RecordRead(header, got, hasher.intdigest(), out)


def plan_runs(order: Sequence[int], locs: Sequence[Location],
              max_bytes: int) -> list[list[int]]:
    """Group ``order`` (indices into ``locs``) into runs, in the order given:
    a record joins the run before it when it starts where that run's last record ends in the
    same segment, the run stays within ``max_bytes`` (``ssd.coalesce_max_bytes``; 0: no
    coalescing) and within MAX_RUN_RECORDS. A record larger than the cap is a run alone."""
    runs: list[list[int]] = []
    run: list[int] = []
    run_bytes = 0
    prev: Location | None = None
    for i in order:
        loc = locs[i]
        size = loc.blocks * BLOCK
        if (prev is not None and loc.segment == prev.segment
                and loc.block == prev.block + prev.blocks and run_bytes + size <= max_bytes
                and len(run) < MAX_RUN_RECORDS):
            run.append(i)
            run_bytes += size
        else:
            if run:
                runs.append(run)
            run, run_bytes = [i], size
        prev = loc
    if run:
        runs.append(run)
    return runs


#: Where one record of a run landed: its header block's offset in the run scratch, and its
#: payload (its ``out``, or a view of the scratch when it could not land there).
Placed = tuple[int, memoryview]


def read_run(store: SegmentStore, buffers: ThreadBuffers, pieces: Executor,
             locs: Sequence[Location], outs: Sequence[memoryview], piece: int
             ) -> Generator[tuple[memoryview, Placed | None], None, None]:
    """Read the back-to-back records at ``locs`` (as ``plan_runs`` groups them; each ``out``
    exactly its record's payload size): header blocks into this thread's run scratch, each
    payload straight into its ``out`` where O_DIRECT allows (else into the scratch; a
    buffered read's padding goes there too). A run of ``2 * piece`` bytes or more is read as
    consecutive preadvs of whole records of about ``piece`` bytes each, the later ones on
    ``pieces``, while the caller checks each piece's records as that piece lands (as
    read_record hashes one large record); a smaller run is one preadv. Yields, per record in
    order, the run scratch (this thread's) and where the record landed, or None when a short
    read did not reach its end (the caller reads it alone); the checks are the caller's, who
    must close the generator (contextlib.closing) when it stops early. Raises OSError (from
    the iteration) when a read fails: the caller then reads the records it has not checked
    alone, so a bad sector costs only the records on it. Nothing lands in any ``out`` once
    the generator is exhausted, closed or has raised."""
    direct = store.direct
    into_out = [not direct or is_direct_capable(out) for out in outs]
    total = sum(loc.blocks for loc in locs) * BLOCK
    # Everything but the payloads that land in their ``out`` goes to the scratch.
    scratch = buffers.run_of(total - sum(out.nbytes for out, ok in zip(outs, into_out,
                                                                       strict=True) if ok))
    split = piece if total >= 2 * piece else total
    fd, base = store.fd(locs[0].segment), store.base(locs[0].segment) + locs[0].block * BLOCK
    # Lay the run out piece by piece: (file offset, iovecs, first record, end record).
    # Per record, the scratch holds its header block, then its payload's padding (or the
    # whole padded payload when it cannot land in its ``out``); scratch bytes that follow
    # one another on the medium go out as one iovec.
    plan: list[tuple[int, list[memoryview], int, int]] = []
    places: list[Placed] = []
    pos = 0  # next free byte of the scratch
    offset = 0  # of the current piece's start, from the run's start
    iov: list[memoryview] = []
    run_from = -1  # where the scratch bytes not yet in ``iov`` start (-1: none)
    piece_bytes, piece_first, last = 0, 0, len(locs) - 1
    for i, (loc, out, ok) in enumerate(zip(locs, outs, into_out, strict=True)):
        header_at, nbytes = pos, out.nbytes
        padded = loc.blocks * BLOCK - BLOCK  # admitted: the record fits ``out`` exactly
        if run_from < 0:
            run_from = pos
        pos += BLOCK
        if ok:
            if nbytes:
                iov.append(scratch[run_from:pos])
                iov.append(out)
                run_from = -1
                if padded > nbytes:
                    run_from = pos
                    pos += padded - nbytes
            places.append((header_at, out))
        else:
            pos += padded
            places.append((header_at, scratch[header_at + BLOCK:header_at + BLOCK + nbytes]))
        piece_bytes += loc.blocks * BLOCK
        if piece_bytes >= split or i == last:
            if run_from >= 0:
                iov.append(scratch[run_from:pos])
                run_from = -1
            plan.append((offset, iov, piece_first, i + 1))
            offset += piece_bytes
            iov, piece_bytes, piece_first = [], 0, i + 1
    futures = [pieces.submit(os.preadv, fd, v, base + o) for o, v, _a, _b in plan[1:]]
    try:
        got = os.preadv(fd, plan[0][1], base)
        for k, (_o, _v, first, end) in enumerate(plan):
            if k:
                got = futures[k - 1].result()
            start = 0
            for j in range(first, end):
                start += locs[j].blocks * BLOCK
                yield scratch, (places[j] if start <= got else None)
    finally:
        for future in futures:  # never leave a piece landing in an `out` after we stop
            future.exception()


def checked(scratch: memoryview, header_at: int, payload: memoryview, size: int
             ) -> RecordRead | CorruptRecordError:
    """One record of a run as read (its header block at ``header_at`` of ``scratch``, its
    payload in ``payload``, ``size`` bytes on the medium): the header parsed (or the
    CorruptRecordError saying why not) and the payload hashed."""
    try:
        header = unpack_header(scratch, header_at)
    except CorruptRecordError as exc:
        return exc
    return RecordRead(header, size, payload_checksum(payload), payload)
