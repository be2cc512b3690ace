"""Where a latency case's threads run: one placement for a case and its reference.

A one-thread round trip over loopback costs mostly the two wake-ups, and on a VM a wake-up
on another core (an inter-processor interrupt, a halted vCPU to resume) costs several times
one on the waker's own core. Left to itself, the scheduler placed a single-threaded
reference server on the client's core and a storage node's connection thread on the other
one (measured on the 2-core VMs here: a raw socket 19-31 µs a 4 KiB round trip, the node
80-120 µs, yet 60 vs 76-87 µs when both servers are pinned to the other core and 16 vs 37
µs when everything shares one): the comparison measured the scheduler, not the servers.
So a latency case pins the client's thread and every thread of the server processes to
named cores for its duration (``pinned``), once per placement (``placements``), and puts
them back afterwards.

Linux only (``os.sched_setaffinity`` on thread ids from ``/proc``); elsewhere there is one
placement, ``unpinned``, and nothing is pinned.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

#: A placement: (name, the client's core, the servers' core); cores None = unpinned.
Placement = tuple[str, int | None, int | None]


def placements() -> list[Placement]:
    """``cross_core`` (the servers on a core of their own, as a peer across a network would
    be) then ``same_core`` (everything on the client's core: the round trip is then the CPU
    time of both sides, wake-ups being switches on one core); only ``same_core`` with one
    usable core, only ``unpinned`` where affinity cannot be set."""
    if not hasattr(os, "sched_setaffinity") or not Path("/proc/self/task").is_dir():
        return [("unpinned", None, None)]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return [("same_core", cores[0], cores[0])]
    return [("cross_core", cores[0], cores[1]), ("same_core", cores[0], cores[0])]


def _threads(pid: int) -> list[int]:
    """The thread ids of process ``pid`` (empty when it is gone)."""
    try:
        return [int(name) for name in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def _set(tid: int, cpus: set[int]) -> None:
    with contextlib.suppress(OSError):  # a thread that ended meanwhile
        os.sched_setaffinity(tid, cpus)


@contextlib.contextmanager
def pinned(placement: Placement, servers: Sequence[int]) -> Iterator[None]:
    """Run the body with the calling thread on the placement's client core and every thread
    of the ``servers`` processes (threads they start meanwhile inherit it) on its server
    core; afterwards each thread is put back on the cores it had (a thread started meanwhile
    on the cores its process's first thread had). Raises OSError if the calling thread
    cannot be pinned; a server thread that ended meanwhile is skipped."""
    _, client_core, server_core = placement
    if client_core is None or server_core is None:
        yield
        return
    mine = os.sched_getaffinity(0)
    saved: dict[int, set[int]] = {}
    first: dict[int, set[int]] = {}
    for pid in servers:
        first[pid] = os.sched_getaffinity(pid)
        for tid in _threads(pid):
            with contextlib.suppress(OSError):
                saved[tid] = os.sched_getaffinity(tid)
            _set(tid, {server_core})
    os.sched_setaffinity(0, {client_core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)
        for pid in servers:
            for tid in _threads(pid):
                _set(tid, saved.get(tid, first[pid]))
