"""The connector's counter file: written off the engine's thread after a step, at once when
forced (close), and a late background write never drops what a forced write put there."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvpool.integrations.vllm.stats import StatsWriter


def read_when(path: Path, check: Callable[[dict[str, Any]], bool],
              timeout: float = 10.0) -> dict[str, Any]:
    """The file's content once ``check`` holds for it (the writer thread is asynchronous)."""
    deadline = time.monotonic() + timeout
    while True:
        if path.exists():
            data: dict[str, Any] = json.loads(path.read_text())
            if check(data):
                return data
        assert time.monotonic() < deadline, f"{path} never showed what was expected"
        time.sleep(0.01)


def test_a_step_s_counters_reach_the_file_from_the_writer_thread(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    stats = StatsWriter(str(path), {"tp_rank": 0})
    stats.add(loaded_chunks=3)
    stats.write()
    data = read_when(path, lambda d: d["counters"]["loaded_chunks"] == 3)
    assert data["tp_rank"] == 0
    stats.add(loaded_chunks=2)
    stats.write()
    read_when(path, lambda d: d["counters"]["loaded_chunks"] == 5)


def test_a_forced_write_is_on_disk_when_it_returns_and_keeps_its_pool_stats(
        tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    stats = StatsWriter(str(path), {})
    for i in range(200):  # background writes racing the forced one
        stats.add(stored_chunks=1)
        stats.write()
        if i == 100:
            stats.write({"dram": {"chunks": 7}}, force=True)
            assert json.loads(path.read_text())["pool"] == {"dram": {"chunks": 7}}
    stats.write({"dram": {"chunks": 9}}, force=True)
    final = json.loads(path.read_text())
    assert final["counters"]["stored_chunks"] == 200 and final["pool"] == {"dram": {"chunks": 9}}
    time.sleep(0.2)  # a background write woken before the forced one changes nothing
    assert json.loads(path.read_text()) == final


def test_close_ends_the_writer_thread(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    stats = StatsWriter(str(path), {})
    stats.add(lookups=1)
    stats.write()
    read_when(path, lambda d: d["counters"]["lookups"] == 1)
    writer = stats._writer
    assert writer is not None and writer.is_alive()
    stats.write({"x": 1}, force=True)
    stats.close()
    assert not writer.is_alive()
    stats.add(lookups=1)
    stats.write()  # closed: no thread, the file keeps the forced write
    assert json.loads(path.read_text())["counters"]["lookups"] == 1 and not writer.is_alive()
    stats.close()  # idempotent


def test_without_a_path_nothing_is_written_and_no_thread_starts(tmp_path: Path) -> None:
    stats = StatsWriter(None, {})
    stats.add(lookups=1)
    stats.write()
    stats.write({"x": 1}, force=True)
    assert stats._writer is None and not list(tmp_path.iterdir())
