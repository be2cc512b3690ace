"""Flat byte views of caller buffers (numpy arrays, bytes, mmaps, tensors' numpy views)."""

from __future__ import annotations

from typing import Any

import numpy as np

#: From this size on ``copy_into`` copies through numpy, which releases the GIL (its ~1 us
#: more per call is lost in the copy).
GIL_FREE_COPY_BYTES = 64 << 10


def advance(bufs: list[memoryview], sent: int) -> None:
    """Drop the first ``sent`` bytes from a scatter-gather list, in place (after a partial
    ``sendmsg``)."""
    while bufs and sent >= bufs[0].nbytes:
        sent -= bufs[0].nbytes
        bufs.pop(0)
    if bufs and sent:
        bufs[0] = bufs[0][sent:]


def byte_view(buf: Any, writable: bool = False) -> memoryview:
    """A flat ``B``-format view of any C-contiguous buffer, without copying.

    Raises ValueError for a non-contiguous buffer, or a read-only one when ``writable``.
    """
    view = memoryview(buf)
    if not view.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    if writable and view.readonly:
        raise ValueError("output buffer is read-only")
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def copy_into(dst: memoryview, src: memoryview) -> None:
    """Copy ``src`` (flat bytes) into the start of ``dst``. A large copy releases the GIL
    while it runs (a memoryview assignment would hold it: a 256 MiB copy on any thread then
    stalls every other thread of the process, a storage node's event loop included).
    Raises ValueError when ``dst`` is shorter than ``src`` or read-only."""
    n = src.nbytes
    if n < GIL_FREE_COPY_BYTES:
        dst[:n] = src
        return
    if dst.nbytes < n:
        raise ValueError(f"cannot copy {n} bytes into {dst.nbytes}")
    np.copyto(np.frombuffer(dst, np.uint8, n), np.frombuffer(src, np.uint8))
