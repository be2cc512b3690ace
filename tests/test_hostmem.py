"""Host memory: /proc/meminfo and cgroup limits, dram.warm_cache_ratio, the node's check."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvpool.config import config_from_dict
from kvpool.errors import ConfigError
from kvpool.hostmem import (
    PROCESS_OVERHEAD_BYTES,
    CgroupMemory,
    cgroup_memory,
    check_node_memory,
    host_memory_total,
    memory_available,
    node_memory_warning,
    parse_meminfo,
)

GiB, MiB = 1 << 30, 1 << 20
NO_CGROUP = CgroupMemory(None, None)


def meminfo(total_kib: int, available_kib: int) -> str:
    return (f"MemTotal:       {total_kib} kB\nMemFree:        {available_kib // 2} kB\n"
            f"MemAvailable:   {available_kib} kB\nHugePages_Total:       0\n")


def test_meminfo_is_read_in_bytes() -> None:
    info = parse_meminfo(meminfo(16 * 1024 * 1024, 8 * 1024 * 1024) + "garbage line\n")
    assert info["MemTotal"] == 16 * GiB
    assert info["MemAvailable"] == 8 * GiB
    assert info["HugePages_Total"] == 0


def test_a_lower_cgroup_limit_bounds_total_and_available() -> None:
    text = meminfo(16 * 1024 * 1024, 12 * 1024 * 1024)
    assert host_memory_total(text, NO_CGROUP) == 16 * GiB
    assert host_memory_total(text, CgroupMemory(4 * GiB, GiB)) == 4 * GiB
    assert memory_available(text, NO_CGROUP) == (12 * GiB, "MemAvailable")
    assert memory_available(text, CgroupMemory(4 * GiB, GiB)) == \
        (3 * GiB, "cgroup memory limit - usage")
    assert memory_available(text, CgroupMemory(64 * GiB, GiB)) == (12 * GiB, "MemAvailable")


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_cgroup_limit_is_the_smallest_on_the_way_to_the_root(tmp_path: Path,
                                                             version: str) -> None:
    proc = tmp_path / "cgroup"
    if version == "v2":
        base = tmp_path / "fs"
        (base / "a" / "b").mkdir(parents=True)
        (base / "cgroup.controllers").write_text("memory\n")
        (base / "a" / "memory.max").write_text(f"{2 * GiB}\n")
        (base / "a" / "b" / "memory.max").write_text("max\n")
        (base / "a" / "b" / "memory.current").write_text(f"{MiB}\n")
        proc.write_text("0::/a/b\n")
    else:
        base = tmp_path / "fs" / "memory"
        (base / "a" / "b").mkdir(parents=True)
        (base / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # unlimited
        (base / "a" / "memory.limit_in_bytes").write_text(f"{3 * GiB}\n")
        (base / "a" / "b" / "memory.limit_in_bytes").write_text(f"{5 * GiB}\n")
        (base / "a" / "b" / "memory.usage_in_bytes").write_text(f"{MiB}\n")
        proc.write_text("5:cpu:/\n4:memory:/a/b\n0::/\n")
    want = 2 * GiB if version == "v2" else 3 * GiB
    assert cgroup_memory(proc, tmp_path / "fs") == CgroupMemory(want, MiB)
    proc.write_text("1:cpu:/\n")
    assert cgroup_memory(proc, tmp_path / "fs") == NO_CGROUP
    assert cgroup_memory(tmp_path / "missing", tmp_path / "fs") == NO_CGROUP


def test_warm_cache_ratio_resolves_dram_capacity_to_whole_slabs() -> None:
    cfg = config_from_dict({"dram": {"warm_cache_ratio": 0.1, "slab_size": "8MiB"}})
    assert cfg.dram.capacity == int(host_memory_total() * 0.1) // (8 * MiB) * (8 * MiB)
    assert cfg.dram.capacity > 0 and cfg.dram.warm_cache_ratio == 0.1
    assert config_from_dict({}).dram.capacity == GiB  # unset: the default capacity


@pytest.mark.parametrize(("dram", "message"), [
    ({"warm_cache_ratio": 0.2, "capacity": "1GiB"},
     "dram.capacity and dram.warm_cache_ratio: set one, not both"),
    ({"warm_cache_ratio": 0.95}, "dram.warm_cache_ratio: Input should be less than or equal"),
    ({"warm_cache_ratio": 0}, "dram.warm_cache_ratio: Input should be greater than 0"),
    ({"warm_cache_ratio": 1e-9}, "is less than one dram.slab_size"),
])
def test_warm_cache_ratio_is_refused_with_capacity_or_out_of_range(
        dram: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"dram": dram})


def test_node_check_warns_above_80_percent_of_available_with_the_figures() -> None:
    text = meminfo(16 * 1024 * 1024, 10 * 1024 * 1024)  # 10 GiB available: 8 GiB may be used
    wb = 256 * MiB
    fits = 8 * GiB - PROCESS_OVERHEAD_BYTES - wb
    assert node_memory_warning(fits, wb, text, NO_CGROUP) is None
    warning = node_memory_warning(fits + 4096, wb, text, NO_CGROUP)
    assert warning is not None
    assert "exceeds 80% of the 10240 MiB available (MemAvailable)" in warning
    assert "reserve 20%" in warning and f"dram.capacity={fits // MiB} MiB" in warning
    # In a 4 GiB cgroup that already uses 1 GiB, 1 GiB of arena is too much.
    tight = node_memory_warning(GiB, wb, text, CgroupMemory(4 * GiB, 3 * GiB))
    assert tight is not None and "(cgroup memory limit - usage)" in tight
    assert node_memory_warning(GiB, wb, "nothing here\n", NO_CGROUP) is None


def test_node_check_on_this_host(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("kvpool.serve")
    with caplog.at_level(logging.WARNING, logger="kvpool.serve"):
        assert check_node_memory(log, 64 * MiB, 64 * MiB) is False
        assert check_node_memory(log, 1 << 50, 0) is True  # a PiB arena: never fits
    [record] = caplog.records
    assert record.levelno == logging.WARNING and record.event == "memory_reserve"
    assert record.dram_capacity == 1 << 50
