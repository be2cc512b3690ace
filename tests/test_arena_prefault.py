"""``dram.prefault``: the arena's pages are taken at open or by a background thread, and
populating never changes what a put already wrote."""

import ctypes
import mmap
from pathlib import Path

import numpy as np
import pytest
from kvtest import small_config

from kvpool.tiers.arena import SlotArena
from kvpool.tiers.prefault import map_address

MIB = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def resident_fraction(arena: SlotArena) -> float:
    pages = arena.capacity // mmap.PAGESIZE
    vec = ctypes.create_string_buffer(pages)
    assert _libc.mincore(map_address(arena._map), arena.capacity, vec) == 0
    return float(np.count_nonzero(np.frombuffer(vec.raw, np.uint8) & 1)) / pages


def test_start_takes_every_page_at_open_and_none_takes_none() -> None:
    start, none = SlotArena(32 * MIB, 4 * MIB, prefault="start"), SlotArena(32 * MIB, 4 * MIB)
    try:
        assert resident_fraction(start) == 1.0
        assert resident_fraction(none) < 0.05
    finally:
        start.close()
        none.close()


def test_background_populates_without_touching_what_puts_wrote() -> None:
    arena = SlotArena(256 * MIB, 1 * MIB, prefault="background")
    try:
        data = np.random.default_rng(0).integers(0, 256, 4 * MIB, dtype=np.uint8)
        # written while the populator runs (it starts at offset 0, where the first slabs are)
        for offset in range(0, 64 * MIB, 8 * MIB):
            arena.buffer[offset:offset + data.nbytes] = data.tobytes()
        assert arena._populating is not None and arena._populating.done.wait(60)
        assert resident_fraction(arena) == 1.0
        for offset in range(0, 64 * MIB, 8 * MIB):
            got = np.frombuffer(arena.buffer[offset:offset + data.nbytes], np.uint8)
            assert np.array_equal(got, data)
    finally:
        arena.close()


def test_closing_while_populating_stops_the_thread() -> None:
    arena = SlotArena(512 * MIB, 1 * MIB, prefault="background")
    populating = arena._populating
    arena.close()
    assert populating is not None and populating.done.is_set()


@pytest.mark.parametrize(("given", "mode"), [(True, "start"), (False, "none"),
                                             ("background", "background")])
def test_the_config_takes_modes_and_the_old_booleans(tmp_path: Path, given: object,
                                                     mode: str) -> None:
    assert small_config(tmp_path, dram={"prefault": given}).dram.prefault == mode
    assert small_config(tmp_path).dram.prefault == "start"
