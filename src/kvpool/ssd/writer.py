"""Writing a batch of records at the offsets the log reserved for them, outside the engine
lock: consecutive records go out in as few pwritev calls as the iovec and size limits allow."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvpool.record import (
    BLOCK,
    HEADER_BLOCK,
    HEADER_SIZE,
    RecordHeader,
    payload_checksum,
    round_up,
)
from kvpool.ssd.directio import ThreadBuffers, aligned_buffer, is_direct_capable
from kvpool.ssd.segments import SegmentStore

MAX_IOV = 512
MAX_WRITE_BYTES = 64 << 20

_ZERO_HEADER_TAIL = bytes(HEADER_BLOCK - HEADER_SIZE)


@dataclass(slots=True)
class Pending:
    """One record on its way to the log."""

    header: RecordHeader
    payload: memoryview  # empty for tombstones
    ns_index: int
    segment: int = -1
    offset: int = -1
    hashed: bool = True  # False: header.checksum is still to be computed (hash_payloads)


def hash_payloads(batch: list[Pending]) -> None:
    """Put each unhashed record's payload checksum into its header (xxh3-64; the GIL is
    held, ~40 µs per MiB): done once the records are placed, so a writer hashes its batch
    while another's batch is being written."""
    for p in batch:
        if not p.hashed:
            p.header = p.header._replace(checksum=payload_checksum(p.payload))
            p.hashed = True


def write_batch(store: SegmentStore, buffers: ThreadBuffers, batch: list[Pending]) -> None:
    """pwritev consecutive records: header blocks and unaligned payloads from this
    thread's staging buffer, aligned payloads (DRAM slots) straight from their memory."""
    direct = store.direct
    copied = [not (direct and is_direct_capable(p.payload)) for p in batch]
    copy_bytes = sum(round_up(p.payload.nbytes) for p, c in zip(batch, copied, strict=True)
                     if c)
    staging = buffers.write_of(len(batch) * BLOCK + copy_bytes)
    pos = len(batch) * BLOCK
    iov: list[memoryview] = []
    iov_bytes = 0
    first = batch[0]
    fd, base = store.fd(first.segment), store.base(first.segment)
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
            pwritev_all(fd, iov, base + offset)
            offset += iov_bytes
            iov, iov_bytes = [], 0
        iov.extend(parts)
        iov_bytes += sum(len(v) for v in parts)
    if iov:
        pwritev_all(fd, iov, base + offset)


def pwritev_all(fd: int, iov: list[memoryview], offset: int) -> None:
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
