"""How much memory this host (or the cgroup this process runs in) has, and the node check.

Two users: ``dram.warm_cache_ratio`` (YRCloudFile's ``warm_cache_ratio``: the DRAM tier as a
share of host memory) needs the total; ``kvpool serve`` warns at start when the DRAM tier plus
the process's own overhead would take more than 80% of the memory available
(YRCloudFile's advice: reserve 20% of a storage node's memory for the rest of the system).

Sources: ``/proc/meminfo`` (MemTotal, MemAvailable) and, when this process is in a cgroup
with a lower memory limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``, the smallest one
on the way up to the root), that limit and the cgroup's current use. Unreadable or
malformed files count as "no such limit"; only a missing MemTotal raises (OSError).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

MEMINFO = Path("/proc/meminfo")
PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")

#: A cgroup v1 limit at or above this is "no limit" (the kernel reports ~2^63 rounded to a page).
_UNLIMITED = 1 << 60

#: Share of available memory the DRAM tier plus process overhead may take (YRCloudFile:
#: "reserve 20% of storage-node memory").
RESERVE_SHARE = 0.8
#: Process overhead besides the arena and the write-behind staging: interpreter, numpy,
#: indexes, sockets, thread stacks. Measured here: a node at rest with a 64 MiB prefaulted
#: arena had 121 MiB RSS (~60 MiB besides the arena); the rest is room for load (per-request
#: buffers, a large SSD index).
PROCESS_OVERHEAD_BYTES = 256 << 20


def parse_meminfo(text: str) -> dict[str, int]:
    """``/proc/meminfo`` text -> ``{"MemTotal": bytes, ...}``; lines it cannot read are skipped."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        fields = rest.split()
        if not sep or not fields or not fields[0].isdigit():
            continue
        scale = 1024 if len(fields) > 1 and fields[1].lower() == "kb" else 1
        out[name.strip()] = int(fields[0]) * scale
    return out


@dataclass(frozen=True)
class CgroupMemory:
    """The tightest memory limit of this process's cgroup (None: none) and its use."""

    limit: int | None
    usage: int | None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_memory(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> CgroupMemory:
    """This process's cgroup memory limit (v2 or v1), the smallest from its own cgroup up to
    the root, and its current use. Never raises: no cgroup, no such files -> no limit."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return CgroupMemory(None, None)
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if controllers == "" and path and (root / "cgroup.controllers").exists():
            base, limit_file, usage_file = root, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            base, limit_file, usage_file = root / "memory", "memory.limit_in_bytes", \
                "memory.usage_in_bytes"
        else:
            continue
        own = base / path.lstrip("/")
        # A cgroup namespace may hide the path above us: start from the deepest that exists.
        while own != base and not own.is_dir():
            own = own.parent
        limits = []
        for d in (own, *own.parents):
            value = _read_int(d / limit_file)
            if value is not None and value < _UNLIMITED:
                limits.append(value)
            if d == base:
                break
        return CgroupMemory(min(limits) if limits else None, _read_int(own / usage_file))
    return CgroupMemory(None, None)


def host_memory_total(meminfo_text: str | None = None,
                      cgroup: CgroupMemory | None = None) -> int:
    """Bytes of memory this process may use in all: MemTotal, or a lower cgroup limit.
    Raises OSError when /proc/meminfo cannot be read or has no MemTotal."""
    info = parse_meminfo(MEMINFO.read_text() if meminfo_text is None else meminfo_text)
    if "MemTotal" not in info:
        raise OSError(f"{MEMINFO}: no MemTotal line")
    limit = (cgroup_memory() if cgroup is None else cgroup).limit
    return min(info["MemTotal"], limit) if limit is not None else info["MemTotal"]


def memory_available(meminfo_text: str, cgroup: CgroupMemory) -> tuple[int, str] | None:
    """Bytes available now and where the figure comes from: MemAvailable (MemFree where the
    kernel lacks it), or what a lower cgroup limit leaves (limit - usage); None when meminfo
    says neither."""
    info = parse_meminfo(meminfo_text)
    host = info.get("MemAvailable", info.get("MemFree"))
    found = None if host is None else (host, "MemAvailable")
    if cgroup.limit is not None:
        left = max(0, cgroup.limit - (cgroup.usage or 0))
        if found is None or left < found[0]:
            found = (left, "cgroup memory limit - usage")
    return found


def node_memory_warning(dram_capacity: int, write_behind_bytes: int, meminfo_text: str,
                        cgroup: CgroupMemory) -> str | None:
    """The warning ``kvpool serve`` logs at start, or None when dram.capacity + overhead
    (PROCESS_OVERHEAD_BYTES + the write-behind staging) fits in RESERVE_SHARE of the memory
    available (see memory_available). None as well when availability cannot be read."""
    found = memory_available(meminfo_text, cgroup)
    if found is None:
        return None
    available, source = found
    need = dram_capacity + PROCESS_OVERHEAD_BYTES + write_behind_bytes
    if need <= RESERVE_SHARE * available:
        return None
    return (f"dram.capacity={_mib(dram_capacity)} + process overhead "
            f"{_mib(PROCESS_OVERHEAD_BYTES)} + pool.write_behind_bytes="
            f"{_mib(write_behind_bytes)} = {_mib(need)} exceeds {RESERVE_SHARE:.0%} of the "
            f"{_mib(available)} available ({source}); YRCloudFile's advice is to reserve 20% "
            f"of a storage node's memory: lower dram.capacity (or set dram.warm_cache_ratio)")


def check_node_memory(log: logging.Logger, dram_capacity: int, write_behind_bytes: int) -> bool:
    """Log node_memory_warning (one WARNING line, event ``memory_reserve``) for this host;
    returns whether it warned. An unreadable /proc/meminfo skips the check (False)."""
    try:
        text = MEMINFO.read_text()
    except OSError:
        return False
    cgroup = cgroup_memory()
    warning = node_memory_warning(dram_capacity, write_behind_bytes, text, cgroup)
    if warning is None:
        return False
    found = memory_available(text, cgroup)
    log.warning("%s", warning, extra={"event": "memory_reserve",
                                      "dram_capacity": dram_capacity,
                                      "available": found[0] if found else None})
    return True


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"
