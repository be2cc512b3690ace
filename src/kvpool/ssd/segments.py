"""Where segments live: a directory of preallocated files, or one raw region (a block device
or an existing file) cut into equal segments. The engine sees (fd, base offset) per segment."""

from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvpool.record import BLOCK
from kvpool.ssd.directio import DirectMode, aligned_buffer, open_file

SEGMENT_MAGIC = b"KVPS"
SEGMENT_VERSION = 1
# magic, version, flags, segment size, segment number, start seq | header xxh3-64
_SEG_BODY = struct.Struct("<4sHHQQQ")
_SEG_CHECK = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    segment_size: int
    number: int
    start_seq: int

    def pack(self) -> memoryview:
        buf = aligned_buffer(BLOCK)
        _SEG_BODY.pack_into(buf, 0, SEGMENT_MAGIC, SEGMENT_VERSION, 0, self.segment_size,
                            self.number, self.start_seq)
        _SEG_CHECK.pack_into(buf, _SEG_BODY.size,
                             xxhash.xxh3_64_intdigest(memoryview(buf)[:_SEG_BODY.size]))
        return memoryview(buf)


def unpack_segment_header(buf: memoryview) -> SegmentHeader | None:
    """None if the block is not a valid segment header (fresh, torn or foreign)."""
    if bytes(buf[:4]) != SEGMENT_MAGIC:
        return None
    (stored,) = _SEG_CHECK.unpack_from(buf, _SEG_BODY.size)
    if xxhash.xxh3_64_intdigest(buf[:_SEG_BODY.size]) != stored:
        return None
    _, version, _, size, number, start_seq = _SEG_BODY.unpack_from(buf)
    if version != SEGMENT_VERSION:
        return None
    return SegmentHeader(size, number, start_seq)


class SegmentStore:
    """Opens the media. Raises ValueError for an unusable layout (a region smaller than two
    segments) and OSError when files cannot be created (e.g. a full disk)."""

    def __init__(self, path: Path, capacity: int, segment_size: int, direct: DirectMode) -> None:
        self.segment_size = segment_size
        self._fds: list[int] = []
        self._bases: list[int] = []
        self.direct = True
        path = path.expanduser()
        if path.exists() and (stat.S_ISBLK(path.stat().st_mode) or path.is_file()):
            self._open_region(path, capacity, direct)
        else:
            self._open_directory(path, capacity, direct)

    def _open_region(self, path: Path, capacity: int, direct: DirectMode) -> None:
        fd, self.direct = open_file(str(path), None, direct)
        size = os.lseek(fd, 0, os.SEEK_END)
        count = min(capacity, size) // self.segment_size
        if count < 2:
            os.close(fd)
            raise ValueError(f"{path}: {size} bytes hold fewer than two segments of "
                             f"ssd.segment_size={self.segment_size}")
        self._fds = [fd]
        self._bases = [i * self.segment_size for i in range(count)]
        self._fd_of = [fd] * count

    def _open_directory(self, path: Path, capacity: int, direct: DirectMode) -> None:
        count = capacity // self.segment_size
        if count < 2:
            raise ValueError(f"ssd.capacity={capacity} holds fewer than two segments of "
                             f"ssd.segment_size={self.segment_size}")
        path.mkdir(parents=True, exist_ok=True)
        for stale in path.glob("seg-*.kvs"):
            number = int(stale.stem.split("-")[1]) if stale.stem[4:].isdigit() else -1
            size = stale.stat().st_size
            if number < 0 or number >= count or size < BLOCK:
                stale.unlink()  # beyond the capacity, or not even a header: re-created below
            elif size > self.segment_size:
                # Trailing junk: cut back to the segment size, its records kept (a file cut
                # short is extended by the preallocation below). A file of another
                # ssd.segment_size has a header that says so: its segment is then free.
                os.truncate(stale, self.segment_size)
        modes = []
        for i in range(count):
            fd, is_direct = open_file(str(path / f"seg-{i:05d}.kvs"), self.segment_size, direct)
            self._fds.append(fd)
            modes.append(is_direct)
        self.direct = all(modes)
        self._bases = [0] * count
        self._fd_of = list(self._fds)

    @property
    def count(self) -> int:
        return len(self._bases)

    def fd(self, segment: int) -> int:
        return self._fd_of[segment]

    def base(self, segment: int) -> int:
        return self._bases[segment]

    def sync(self, segment: int) -> None:
        os.fdatasync(self._fd_of[segment])

    def fds(self) -> list[int]:
        return list(self._fds)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
