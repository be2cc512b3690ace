"""The DRAM arena: one mmap carved into slabs, each slab into equal page-aligned slots.

PagedAttention's lesson applied to host memory: every chunk of a size class takes one slot of
exactly its (4 KiB-rounded) size, so there is no fragmentation and alloc/free are O(1) list
operations. Slabs move between size classes only when a class is empty and must steal (the
tier evicts the slab's residents first). Not thread-safe: the owning tier locks.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass, field

import numpy as np

from kvpool.record import BLOCK, round_up
from kvpool.tiers.prefault import BackgroundPopulate, map_address, populate


@dataclass
class SizeClass:
    slot_size: int
    free: list[int] = field(default_factory=list)  # slot offsets
    slabs: list[int] = field(default_factory=list)  # slab offsets owned
    used: int = 0


class SlotArena:
    """Raises ValueError if capacity or slab size is not positive and page-aligned, and OSError
    if the backing memory cannot be mapped."""

    def __init__(self, capacity: int, slab_size: int, shm_path: str | None = None,
                 prefault: str = "none") -> None:
        if slab_size <= 0 or slab_size % BLOCK:
            raise ValueError(f"dram.slab_size must be a positive multiple of {BLOCK}")
        slabs = capacity // slab_size
        if slabs < 1:
            raise ValueError(f"dram.capacity={capacity} is smaller than one dram.slab_size="
                             f"{slab_size}")
        self.slab_size = slab_size
        self.capacity = slabs * slab_size
        self._shm_path = shm_path
        if shm_path:
            fd = os.open(shm_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, self.capacity)
                self._map = mmap.mmap(fd, self.capacity, mmap.MAP_SHARED)
            finally:
                os.close(fd)
        else:
            self._map = mmap.mmap(-1, self.capacity, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.buffer = memoryview(self._map)
        self._populating: BackgroundPopulate | None = None
        if prefault not in ("none", "start", "background"):
            raise ValueError(f"dram.prefault must be none, start or background, not {prefault!r}")
        if prefault == "start" and not populate(map_address(self._map), self.capacity):
            pages = np.frombuffer(self._map, dtype=np.uint8)[::mmap.PAGESIZE]
            pages[:] = 0  # touch every page: before any put, so nothing is overwritten
            del pages
        elif prefault == "background":  # slabs are handed out from offset 0 up: same order
            self._populating = BackgroundPopulate(map_address(self._map), self.capacity,
                                                  slab_size)
        self._free_slabs = list(range(self.capacity - slab_size, -1, -slab_size))
        self.classes: dict[int, SizeClass] = {}

    def slot_size_for(self, nbytes: int) -> int:
        """Slot size for a payload; raises ValueError if it cannot fit a slab."""
        size = round_up(max(nbytes, 1))
        if size > self.slab_size:
            raise ValueError(f"chunk of {nbytes} bytes exceeds dram.slab_size={self.slab_size}; "
                             "raise dram.slab_size")
        return size

    def size_class(self, slot_size: int) -> SizeClass:
        cls = self.classes.get(slot_size)
        if cls is None:
            cls = self.classes[slot_size] = SizeClass(slot_size)
        return cls

    def alloc(self, slot_size: int) -> int | None:
        """A free slot's offset, taking a free slab if needed; None if the class is full and
        no slab is free (the caller evicts, or steals a slab)."""
        cls = self.size_class(slot_size)
        if not cls.free and self._free_slabs:
            self.give_slab(cls, self._free_slabs.pop())
        if not cls.free:
            self._reclaim_idle_slab(cls)
        if not cls.free:
            return None
        cls.used += 1
        return cls.free.pop()

    def _reclaim_idle_slab(self, cls: SizeClass) -> None:
        """Move one slab from a class that holds no chunk at all (emptied by deletes or an
        invalidated namespace): without this, a class that has victims of its own would evict
        them forever while another class's memory sits idle."""
        for donor in self.classes.values():
            if donor is not cls and donor.used == 0 and donor.slabs:
                slab = donor.slabs[-1]
                self.take_slab(donor, slab)
                self.give_slab(cls, slab)
                return

    def free(self, slot_size: int, offset: int) -> None:
        cls = self.classes[slot_size]
        cls.used -= 1
        cls.free.append(offset)

    def give_slab(self, cls: SizeClass, slab: int) -> None:
        per = self.slab_size // cls.slot_size
        cls.slabs.append(slab)
        cls.free.extend(range(slab + (per - 1) * cls.slot_size, slab - 1, -cls.slot_size))

    def slots_taken(self, cls: SizeClass, slab: int) -> int:
        """How many of ``slab``'s slots in ``cls`` are not on the free list: residents, and
        slots reserved or handed to a writer that are not published yet."""
        end = slab + self.slab_size
        return self.slab_size // cls.slot_size - sum(1 for o in cls.free if slab <= o < end)

    def take_slab(self, cls: SizeClass, slab: int) -> None:
        """Remove an (entirely free) slab from a class; its slots must all be on the free list."""
        end = slab + self.slab_size
        cls.free = [o for o in cls.free if not slab <= o < end]
        cls.slabs.remove(slab)

    def slab_of(self, offset: int) -> int:
        return offset - offset % self.slab_size

    def view(self, offset: int, nbytes: int) -> memoryview:
        return self.buffer[offset:offset + nbytes]

    def close(self) -> None:
        """Unmap. If views are still exported the mapping stays until they are collected."""
        if self._populating is not None:
            self._populating.stop()
        try:
            self.buffer.release()
            self._map.close()
        except BufferError:
            pass
        if self._shm_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._shm_path)
