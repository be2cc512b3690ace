"""Flat byte views of caller buffers (numpy arrays, bytes, mmaps, tensors' numpy views)."""

from __future__ import annotations

from typing import Any


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
