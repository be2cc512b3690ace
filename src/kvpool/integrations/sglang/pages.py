"""Copies between SGLang's host pool pages (raw addresses) and kvpool chunk buffers.

``get_page_buffer_meta`` gives, per page, the addresses of its pieces inside the host pool's
one big buffer; a piece is copied with one ``memmove`` (ctypes releases the GIL for it)
straight to or from its offset in a chunk buffer: a reserved DRAM slot on a write, a pinned
DRAM slot or a staging buffer on a read. No intermediate copy, no tensor is built per page.

Failure contract: the addresses are trusted (they come from the host pool); a buffer of the
wrong size raises ValueError before anything is copied.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpool.integrations.sglang.layout import PageGeometry


def buffer_address(buf: Any, nbytes: int) -> int:
    """The address of a buffer (memoryview, numpy array, bytearray) of exactly ``nbytes``
    bytes, read-only ones included. Raises ValueError for another size."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    if arr.nbytes != nbytes:
        raise ValueError(f"chunk buffer has {arr.nbytes} bytes, pages {nbytes}")
    return int(arr.ctypes.data)


class PageCopier:
    """Gathers / scatters the pieces of pages of one geometry."""

    def __init__(self, geom: PageGeometry) -> None:
        self.geom = geom
        self.pieces = geom.pieces_per_page
        self.piece_bytes = geom.piece_bytes
        self.offsets = geom.piece_offsets()

    def page_pointers(self, ptrs: Sequence[int], sizes: Sequence[int],
                      pages: int) -> list[Sequence[int]]:
        """Split ``get_page_buffer_meta``'s flat pointer list into one list per page. Raises
        ValueError when the host pool's pieces do not match the geometry."""
        if len(ptrs) != pages * self.pieces or any(s != self.piece_bytes for s in sizes):
            raise ValueError(f"host pool gave {len(ptrs)} pieces of {set(sizes)} bytes for "
                             f"{pages} pages; expected {self.pieces} of {self.piece_bytes}")
        n = self.pieces
        return [ptrs[i * n:(i + 1) * n] for i in range(pages)]

    def gather(self, pieces: Sequence[int], dst: Any) -> None:
        """Copy one page from the host pool (its piece addresses) into chunk buffer ``dst``."""
        base = buffer_address(dst, self.geom.page_bytes)
        size = self.piece_bytes
        for ptr, off in zip(pieces, self.offsets, strict=True):
            ctypes.memmove(base + off, ptr, size)

    def scatter(self, src: Any, pieces: Sequence[int]) -> None:
        """Copy chunk buffer ``src`` into one page of the host pool."""
        base = buffer_address(src, self.geom.page_bytes)
        size = self.piece_bytes
        for ptr, off in zip(pieces, self.offsets, strict=True):
            ctypes.memmove(ptr, base + off, size)
