"""Aligned buffers and O_DIRECT file handles.

O_DIRECT needs every buffer address, length and file offset aligned to the logical block size;
kvpool aligns everything to 4 KiB. Anonymous mmaps are page-aligned, so they serve as staging
buffers and DRAM slots alike.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
from typing import Literal

import numpy as np

from kvpool.record import BLOCK

log = logging.getLogger("kvpool.ssd")
_warned_fallback = False

DirectMode = Literal["auto", "on", "off"]


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """A zero-filled, page-aligned anonymous buffer of at least one block."""
    return mmap.mmap(-1, max(BLOCK, (nbytes + BLOCK - 1) // BLOCK * BLOCK))


def buffer_address(view: memoryview) -> int:
    """Address of a buffer's first byte (works for read-only buffers too)."""
    if not len(view):
        return 0
    if not view.readonly and view.c_contiguous:  # ~0.5 us where numpy's .ctypes takes ~3
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def is_direct_capable(view: memoryview) -> bool:
    """True if ``view`` can be handed to O_DIRECT IO as is (address and length aligned)."""
    return view.nbytes % BLOCK == 0 and buffer_address(view) % BLOCK == 0


class ThreadBuffers(threading.local):
    """Per-thread aligned buffers, reused across calls: a fresh mmap per IO costs a syscall
    and first-touch page faults that are slower than the IO itself for small chunks."""

    def __init__(self) -> None:
        self.header = memoryview(aligned_buffer(BLOCK))
        self.staging = memoryview(aligned_buffer(BLOCK))
        self.write = memoryview(aligned_buffer(BLOCK))
        self.run = memoryview(aligned_buffer(BLOCK))  # a coalesced read's headers (reader.py)

    def staging_of(self, nbytes: int) -> memoryview:
        if len(self.staging) < nbytes:
            self.staging = memoryview(aligned_buffer(nbytes))
        return self.staging[:nbytes]

    def run_of(self, nbytes: int) -> memoryview:
        if len(self.run) < nbytes:
            self.run = memoryview(aligned_buffer(nbytes))
        return self.run[:nbytes]

    def write_of(self, nbytes: int) -> memoryview:
        if len(self.write) < nbytes:
            self.write = memoryview(aligned_buffer(nbytes))
        return self.write[:nbytes]


class DirectIOUnsupported(OSError):
    pass


def open_file(path: str, size: int | None, mode: DirectMode) -> tuple[int, bool]:
    """Open (creating and preallocating to ``size`` when given) for aligned IO.

    Returns (fd, uses_o_direct). With ``mode="auto"`` a file system that refuses O_DIRECT
    (tmpfs on older kernels, some FUSE mounts) gets buffered IO and one warning per process;
    with ``"on"`` it raises DirectIOUnsupported. Raises OSError (e.g. ENOSPC, EMFILE) if the
    file cannot be opened, created or preallocated. On any failure no fd stays open; a file
    this call created (or extended) stays on disk: the caller knows whether it existed before.
    """
    global _warned_fallback
    flags = os.O_RDWR | (os.O_CREAT if size is not None else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if size is not None and os.fstat(fd).st_size < size:
            os.posix_fallocate(fd, 0, size)
        if mode == "off":
            return fd, False
        dfd = _open_direct(path)
    except BaseException:
        os.close(fd)
        raise
    if dfd is None:
        if mode == "on":
            os.close(fd)
            raise DirectIOUnsupported(errno.EINVAL, f"{path}: file system refuses O_DIRECT")
        if not _warned_fallback:
            log.warning("O_DIRECT is not supported for %s; using buffered IO (reads may be "
                        "served from the page cache)", path)
            _warned_fallback = True
        return fd, False
    os.close(fd)
    return dfd, True


def _open_direct(path: str) -> int | None:
    """An O_DIRECT fd that has served one aligned read, or None if the file system refuses
    O_DIRECT (EINVAL / EOPNOTSUPP at open or at the first read). Other errors raise; no fd
    stays open either way unless returned."""
    try:
        dfd = os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise
    try:
        os.preadv(dfd, [aligned_buffer(BLOCK)], 0)
    except OSError as exc:
        os.close(dfd)
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise
    except BaseException:
        os.close(dfd)
        raise
    return dfd


class AlignedBuffers:
    """Reusable page-aligned buffers of ``nbytes`` (O_DIRECT reads land in them without a
    bounce); thread-safe; keeps at most ``keep`` returned buffers for reuse."""

    def __init__(self, nbytes: int, keep: int = 64) -> None:
        self.nbytes = nbytes
        self._keep = keep
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self) -> np.ndarray:
        with self._lock:
            if self._free:
                return self._free.pop()
        return np.frombuffer(aligned_buffer(self.nbytes), np.uint8, self.nbytes)

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(buf)
