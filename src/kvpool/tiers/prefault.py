"""Taking a DRAM arena's pages before its first writes, so no engine save pays for them.

A fresh anonymous mapping costs a page fault and a zero-fill per 4 KiB page on its first
write: on these VMs a copy into fresh memory runs at ~1 GB/s, into touched memory at 5-10
GB/s, so the first requests of an engine saved several times slower than later ones. The
kernel's ``MADV_POPULATE_WRITE`` (Linux 5.14+) faults a range in writable without changing
its contents, so it is safe while other threads already write into the range: the arena can
populate in the background, slab by slab in allocation order, at a low priority.

Failure contract: where the kernel refuses the advice, ``populate`` returns False and the
background populator stops (logged once); pages then fault on first write, as without it.
Nothing here can change an arena's contents.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import sys
import threading

from kvpool.priority import lower_thread_priority

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def map_address(mapping: mmap.mmap) -> int:
    """The address of ``mapping``'s first byte (valid until it is closed); no buffer export
    is kept, so the mapping can still be closed."""
    anchor = ctypes.c_char.from_buffer(mapping)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


#: ``populate`` advises at most this much at once: between two pieces the main thread runs
#: its signal handlers, so a Ctrl-C or SIGTERM during a large arena's prefault at start is
#: handled within one piece (~0.1 s here) instead of after the whole arena.
POPULATE_PIECE_BYTES = 256 << 20


def populate(address: int, nbytes: int) -> bool:
    """Fault ``nbytes`` at ``address`` in, writable, contents unchanged, in pieces of
    POPULATE_PIECE_BYTES. False where the kernel does not support it (or the range is not
    mapped); the GIL is released meanwhile. A signal handler's exception (KeyboardInterrupt)
    propagates between pieces."""
    if not sys.platform.startswith("linux") or nbytes <= 0:
        return False
    for offset in range(0, nbytes, POPULATE_PIECE_BYTES):
        size = min(POPULATE_PIECE_BYTES, nbytes - offset)
        if _libc.madvise(address + offset, size, MADV_POPULATE_WRITE) != 0:
            break
    else:
        return True
    err = ctypes.get_errno()
    log.info("kvpool: MADV_POPULATE_WRITE refused (%s); DRAM pages fault on first write",
             errno.errorcode.get(err, err))
    return False


class BackgroundPopulate:
    """Populates ``[address, address + nbytes)`` in ``step``-byte pieces on a thread at nice
    +10. ``stop()`` waits for the piece in progress (at most one step) and must run before
    the range is unmapped."""

    def __init__(self, address: int, nbytes: int, step: int) -> None:
        self._address, self._nbytes, self._step = address, nbytes, step
        self._stop = threading.Event()
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpool-prefault", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        lower_thread_priority(10)
        try:
            for offset in range(0, self._nbytes, self._step):
                if self._stop.is_set():
                    return
                size = min(self._step, self._nbytes - offset)
                if not populate(self._address + offset, size):
                    return
        finally:
            self.done.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
