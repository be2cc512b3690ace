"""Where segments live: a directory of preallocated files, or one raw region (a block device
or an existing file) cut into equal segments. The engine sees (fd, base offset) per segment.

Opening takes the medium's lock first (one owner, ssd/lock.py), then, for a directory, works
out what is missing and checks it against the free space before preallocating anything.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvpool.errors import InsufficientSpaceError
from kvpool.record import BLOCK
from kvpool.ssd.directio import DirectMode, aligned_buffer, open_file
from kvpool.ssd.lock import MediaLock, lock_directory, lock_region

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


@dataclass(frozen=True, slots=True)
class DirectoryPlan:
    """What opening a segment directory will do, worked out before anything is written."""

    stale: list[Path]  # beyond the capacity, misnamed, or too short for a header: removed
    existing: set[int]  # segment numbers whose file is kept, records and all
    oversized: list[Path]  # kept files with trailing junk: cut back to the segment size
    missing_bytes: int  # bytes still to preallocate (new files, and short ones extended)
    reclaimable_bytes: int  # space that removing the stale files frees


def plan_directory(path: Path, count: int, segment_size: int) -> DirectoryPlan:
    """Survey ``path``: files ``seg-NNNNN.kvs`` numbered below ``count`` that can hold a
    segment header are kept, whatever their size (trailing junk is cut, a short file is
    extended; a file of another ssd.segment_size has a header that says so, and its segment
    is then free); other regular files of that pattern are stale."""
    stale, oversized, existing = [], [], set()
    missing, reclaimable = 0, 0
    for file in path.glob("seg-*.kvs"):
        st = file.lstat()
        if not stat.S_ISREG(st.st_mode):
            continue  # not ours to remove; opening it fails with a clear OSError
        digits = file.stem[4:]
        number = int(digits) if digits.isdigit() else -1
        if 0 <= number < count and st.st_size >= BLOCK:
            existing.add(number)
            missing += max(0, segment_size - st.st_size)
            if st.st_size > segment_size:
                oversized.append(file)  # cutting it frees its blocks past the segment size
                reclaimable += max(0, st.st_blocks * 512 - segment_size)
        else:
            stale.append(file)
            # A file with other links (or held open elsewhere) frees nothing when removed; the
            # latter cannot be seen from here, the cleanup on a mid-way ENOSPC covers it.
            reclaimable += st.st_blocks * 512 if st.st_nlink == 1 else 0
    missing += (count - len(existing)) * segment_size
    return DirectoryPlan(stale, existing, oversized, missing, reclaimable)


def _size(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= size:
            return f"{n} bytes ({n / size:.1f} {unit})"
    return f"{n} bytes"


class SegmentStore:
    """Opens the media and holds it exclusively (ssd/lock.py) until close().

    Raises ValueError for an unusable layout (a region smaller than two segments),
    CacheDirLockedError if another engine holds the directory or region,
    InsufficientSpaceError if the segment files do not fit in the free space (checked before
    anything is preallocated), and OSError when files cannot be opened or created (EMFILE,
    O_DIRECT refused with ``direct="on"``, ...). On any failure every fd this open took is
    closed, every segment file it created is removed (files that existed before are kept) and
    the lock is released.
    """

    def __init__(self, path: Path, capacity: int, segment_size: int, direct: DirectMode) -> None:
        self.segment_size = segment_size
        self._fds: list[int] = []
        self._bases: list[int] = []
        self._fd_of: list[int] = []
        self._lock: MediaLock | None = None
        self.direct = True
        path = path.expanduser()
        created: list[Path] = []
        try:
            if path.exists() and (stat.S_ISBLK(path.stat().st_mode) or path.is_file()):
                self._open_region(path, capacity, direct)
            else:
                self._open_directory(path, capacity, direct, created)
        except BaseException:
            self.close()
            for file in created:
                with contextlib.suppress(OSError):
                    file.unlink()
            raise

    def _open_region(self, path: Path, capacity: int, direct: DirectMode) -> None:
        self._lock = lock_region(path)
        fd, self.direct = open_file(str(path), None, direct)
        self._fds = [fd]
        size = os.lseek(fd, 0, os.SEEK_END)
        count = min(capacity, size) // self.segment_size
        if count < 2:
            raise ValueError(f"{path}: {size} bytes hold fewer than two segments of "
                             f"ssd.segment_size={self.segment_size}")
        self._bases = [i * self.segment_size for i in range(count)]
        self._fd_of = [fd] * count

    def _open_directory(self, path: Path, capacity: int, direct: DirectMode,
                        created: list[Path]) -> None:
        count = capacity // self.segment_size
        if count < 2:
            raise ValueError(f"ssd.capacity={capacity} holds fewer than two segments of "
                             f"ssd.segment_size={self.segment_size}")
        path.mkdir(parents=True, exist_ok=True)
        self._lock = lock_directory(path)
        plan = plan_directory(path, count, self.segment_size)
        fs = os.statvfs(path)
        free = fs.f_bavail * fs.f_frsize
        if plan.missing_bytes > free + plan.reclaimable_bytes:
            freeable = (f" (+ {_size(plan.reclaimable_bytes)} in old segment files)"
                        if plan.reclaimable_bytes else "")
            raise InsufficientSpaceError(
                errno.ENOSPC,
                f"{path}: ssd.capacity={capacity} needs {_size(plan.missing_bytes)} more "
                f"preallocated ({count - len(plan.existing)} segment files of "
                f"ssd.segment_size={self.segment_size}) but the file system has "
                f"{_size(free)} free{freeable}; lower ssd.capacity, or point ssd.path (or "
                f"cache_dir) at a file system with room", str(path))
        for file in plan.stale:
            file.unlink()  # beyond the capacity, or not even a header: re-created below
        for file in plan.oversized:
            os.truncate(file, self.segment_size)  # trailing junk: records kept
        modes = []
        for i in range(count):
            name = path / f"seg-{i:05d}.kvs"
            if not os.path.lexists(name):
                created.append(name)  # before open_file: it may create the file, then fail
            try:
                fd, is_direct = open_file(str(name), self.segment_size, direct)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                raise InsufficientSpaceError(
                    exc.errno,
                    f"{path}: ran out of space preallocating {name.name} (ssd.capacity="
                    f"{capacity} needs {_size(plan.missing_bytes)}, {_size(free)} was free "
                    f"before; another writer, file system overhead or removed files still held "
                    f"open took the rest); lower "
                    f"ssd.capacity, or point ssd.path (or cache_dir) at a file system with "
                    f"room", str(path)) from exc
            self._fds.append(fd)
            modes.append(is_direct)
        self.direct = all(modes)
        self._bases = [0] * count
        self._fd_of = list(self._fds)

    @classmethod
    def open_read_only(cls, path: Path) -> SegmentStore:
        """A directory's segment files as they are, for offline checks (``kvpool admin
        verify``): taken under the directory's lock like an engine's open (so no engine can
        have it open meanwhile), opened read-only; nothing is created, cut or removed. The
        store has a segment for every number up to the highest file; a missing number has no
        fd (its reads fail with OSError). ``segment_size`` is the size most segment headers
        name (0 if none is valid). Raises CacheDirLockedError if an engine holds the
        directory, FileNotFoundError / NotADirectoryError for a path that is not a
        directory, OSError if a file cannot be opened."""
        if not path.is_dir():
            raise (NotADirectoryError if path.exists() else FileNotFoundError)(
                errno.ENOTDIR if path.exists() else errno.ENOENT, "not a directory", str(path))
        store = cls.__new__(cls)
        store._fds, store._bases, store._fd_of, store.direct = [], [], [], False
        store._lock = lock_directory(path)
        try:
            numbered = {int(f.stem[4:]): f for f in path.glob("seg-*.kvs")
                        if f.stem[4:].isdigit() and f.is_file()}
            count = max(numbered, default=-1) + 1
            store._fd_of = [-1] * count
            store._bases = [0] * count
            sizes: dict[int, int] = {}
            block = memoryview(aligned_buffer(BLOCK))
            for number, file in sorted(numbered.items()):
                fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
                store._fds.append(fd)
                store._fd_of[number] = fd
                header = unpack_segment_header(block) if os.preadv(fd, [block], 0) == BLOCK \
                    else None
                if header is not None:
                    sizes[header.segment_size] = sizes.get(header.segment_size, 0) + 1
            store.segment_size = max(sizes, key=lambda n: sizes[n], default=0)
        except BaseException:
            store.close()
            raise
        return store

    @property
    def count(self) -> int:
        return len(self._bases)

    def fd(self, segment: int) -> int:
        return self._fd_of[segment]

    def base(self, segment: int) -> int:
        return self._bases[segment]

    def sync(self, segment: int) -> None:
        os.fdatasync(self._fd_of[segment])

    def close(self) -> None:
        """Close every fd, then release the lock. Idempotent."""
        fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def check_geometry(capacity: int, segment_size: int, read_piece_bytes: int) -> None:
    """Raises ValueError (naming the ssd.* setting) for a geometry no engine can use."""
    if segment_size % BLOCK or segment_size < 4 * BLOCK:
        raise ValueError(f"ssd.segment_size must be a multiple of {BLOCK} and at least "
                         f"{4 * BLOCK}, got {segment_size}")
    if read_piece_bytes <= 0 or read_piece_bytes % BLOCK:
        raise ValueError(f"ssd.read_piece_bytes must be a positive multiple of {BLOCK}, "
                         f"got {read_piece_bytes}")
    if capacity // segment_size > 0xFFFF:
        raise ValueError(f"ssd.capacity={capacity} is more than 65535 segments of "
                         f"ssd.segment_size={segment_size}; raise ssd.segment_size")
