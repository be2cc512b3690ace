"""Reading one record of the SSD log into a caller's buffer: the header and the payload in
one preadv, a large payload in pieces whose checksum overlaps the IO. The checks that make a
read a hit or a miss (key, namespace, length, checksum) stay in the engine's read path."""

from __future__ import annotations

import os
from concurrent.futures import Executor
from typing import NamedTuple

import xxhash

from kvpool.record import BLOCK, HEADER_BLOCK, RecordHeader, round_up, unpack_header
from kvpool.ssd.directio import ThreadBuffers, is_direct_capable
from kvpool.ssd.index import Location
from kvpool.ssd.segments import SegmentStore


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
    payload = out if direct_into_out else buffers.staging_of(round_up(nbytes))
    # One thread reads header + first piece and hashes each piece as it lands while the
    # piece pool reads the rest: the checksum no longer waits for the whole IO.
    split = pipeline_min is not None and direct_into_out and nbytes >= pipeline_min
    first = piece if split else len(payload)
    rest = [(o, min(piece, nbytes - o)) for o in range(first, nbytes, piece)] if split else []
    futures = [pieces.submit(os.preadv, fd, [payload[o:o + n]], pos + HEADER_BLOCK + o)
               for o, n in rest]
    try:
        got = os.preadv(fd, [hblock, payload[:first]], pos)
        header = unpack_header(hblock)
        hasher = xxhash.xxh3_64(payload[:min(first, nbytes)])
        for future, (o, n) in zip(futures, rest, strict=True):
            got += future.result()
            hasher.update(payload[o:o + n])
    finally:
        for future in futures:  # never leave a piece landing in `out` after we return
            future.exception()
    return RecordRead(header, got, hasher.intdigest(), payload)
