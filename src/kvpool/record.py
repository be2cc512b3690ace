"""The on-media record format (DESIGN.md section 3).

A record is a 4 KiB header block followed by the payload padded to 4 KiB. The header block
starts with a fixed 128-byte header (below) and is zero after it; the payload therefore starts
page-aligned on disk, so an O_DIRECT read can land in a DRAM slot or caller buffer directly.

Header (little-endian):
    magic b"KVPR" | version u16 | flags u16 | key 16s | namespace id 16s | layout id u64 |
    payload length u64 | seq u64 | payload xxh3-64 u64 | reserved (48 zero bytes) |
    header xxh3-64 u64 (over the 120 bytes before it)
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

from kvpool.errors import CorruptRecordError

BLOCK = 4096
HEADER_BLOCK = BLOCK
MAGIC = b"KVPR"
VERSION = 1
HEADER_SIZE = 128

# seq = epoch << EPOCH_SHIFT | counter; every open of the engine starts a new epoch, so one
# life of a segment (from its start seq to its last record) lies inside one epoch
EPOCH_SHIFT = 40

FLAG_TOMBSTONE = 1  # deletes `key`
FLAG_NS_TOMBSTONE = 2  # invalidates every earlier record of `namespace_id`

_BODY = struct.Struct("<4sHH16s16sQQQQ48x")
_CHECK = struct.Struct("<Q")
_HEADER = struct.Struct("<4sHH16s16sQQQQ48xQ")  # _BODY then _CHECK, for one unpack
assert _BODY.size + _CHECK.size == HEADER_SIZE == _HEADER.size


def round_up(n: int, to: int = BLOCK) -> int:
    return (n + to - 1) // to * to


def record_size(payload_len: int) -> int:
    """Bytes one record occupies on media: header block + payload padded to 4 KiB."""
    return HEADER_BLOCK + round_up(payload_len)


def payload_checksum(payload: memoryview | bytes) -> int:
    return int(xxhash.xxh3_64_intdigest(payload))


class RecordHeader(NamedTuple):
    """A record's header fields (immutable). A NamedTuple rather than a frozen dataclass:
    one is built per record read, and a frozen dataclass costs ~4x as much to build."""

    key: bytes
    namespace_id: bytes
    layout_id: int
    payload_len: int
    seq: int
    checksum: int
    flags: int = 0

    @property
    def is_tombstone(self) -> bool:
        return bool(self.flags & (FLAG_TOMBSTONE | FLAG_NS_TOMBSTONE))

    def pack_into(self, buf: memoryview | bytearray, offset: int = 0) -> None:
        """Write the 128-byte header at ``buf[offset:]``; the rest of the block is untouched."""
        _BODY.pack_into(buf, offset, MAGIC, VERSION, self.flags, self.key, self.namespace_id,
                        self.layout_id, self.payload_len, self.seq, self.checksum)
        body = memoryview(buf)[offset:offset + _BODY.size]
        _CHECK.pack_into(buf, offset + _BODY.size, xxhash.xxh3_64_intdigest(body))

    def pack(self) -> bytes:
        buf = bytearray(HEADER_SIZE)
        self.pack_into(buf)
        return bytes(buf)


def describes(buf: memoryview, offset: int, key: bytes, namespace_id: bytes | None,
              payload: memoryview) -> bool:
    """True when the header at ``offset`` of ``buf`` is a valid live record of ``key``
    (under ``namespace_id`` unless None) whose payload is ``payload``: its length and
    checksum match. False for anything else, without saying why (a caller that needs the
    reason parses the header with unpack_header). The lean check of a batched read: one
    unpack and two hashes per record."""
    try:
        (magic, version, flags, hkey, ns, _layout, length, _seq, checksum,
         stored) = _HEADER.unpack_from(buf, offset)
    except struct.error:
        return False
    return (magic == MAGIC and hkey == key and length == payload.nbytes
            and not flags & (FLAG_TOMBSTONE | FLAG_NS_TOMBSTONE) and version == VERSION
            and (namespace_id is None or ns == namespace_id)
            and xxhash.xxh3_64_intdigest(buf[offset:offset + _BODY.size]) == stored
            and xxhash.xxh3_64_intdigest(payload) == checksum)


def unpack_header(buf: memoryview | bytes, offset: int = 0) -> RecordHeader:
    """Parse and validate a header.

    Raises CorruptRecordError if the magic, version or header checksum is wrong (a torn,
    stale or never-written block reads as corrupt, never as a record), or the buffer holds
    fewer than HEADER_SIZE bytes from ``offset``.
    """
    try:  # one unpack of the whole header: this runs once per record read
        (magic, version, flags, key, ns, layout_id, length, seq, checksum,
         stored) = _HEADER.unpack_from(buf, offset)
    except struct.error:
        raise CorruptRecordError("short header") from None
    if magic != MAGIC:
        raise CorruptRecordError("bad magic")
    if xxhash.xxh3_64_intdigest(memoryview(buf)[offset:offset + _BODY.size]) != stored:
        raise CorruptRecordError("header checksum mismatch")
    if version != VERSION:
        raise CorruptRecordError(f"unsupported record version {version}")
    return RecordHeader(key, ns, layout_id, length, seq, checksum, flags)
