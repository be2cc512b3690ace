"""kvpool.bench.cores: a latency case's client thread and every thread of its server
processes run on the named cores for the case only, and go back where they were."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvpool.bench.cores import pinned, placements

# A server with threads: the main thread starts one at once and one more when told (a line
# on stdin), which the test does while it holds a placement: that thread must inherit it,
# and be put back afterwards.
SERVER = """
import sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("ready", flush=True)
sys.stdin.readline()
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("started", flush=True)
time.sleep(60)
"""


def _affinities(pid: int) -> dict[int, set[int]]:
    return {int(t): os.sched_getaffinity(int(t)) for t in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_each_placement_pins_the_caller_and_every_server_thread_then_puts_them_back() -> None:
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdin is not None and server.stdout is not None
        assert server.stdout.readline().strip() == "ready"
        mine = os.sched_getaffinity(0)
        before = _affinities(server.pid)
        names = [p[0] for p in placements()]
        assert names in (["cross_core", "same_core"], ["same_core"])
        for n, placement in enumerate(placements()):
            _, client_core, server_core = placement
            with pinned(placement, [server.pid]):
                assert os.sched_getaffinity(0) == {client_core}
                if n == 0:  # the late thread starts inside the first placement
                    server.stdin.write("go\n")
                    server.stdin.flush()
                    assert server.stdout.readline().strip() == "started"
                during = _affinities(server.pid)
                assert set(during) >= set(before)
                assert all(cpus == {server_core} for cpus in during.values()), during
            assert os.sched_getaffinity(0) == mine
            after = _affinities(server.pid)
            for tid, cpus in after.items():
                assert cpus == before.get(tid, before[server.pid]), (tid, cpus)
            before = after
        assert len(before) == 3, "the late thread did not start"
        if len(mine) >= 2:
            cross = placements()[0]
            assert cross[1] != cross[2]  # servers on a core of their own
    finally:
        server.kill()
        server.wait()


def test_a_failure_inside_still_puts_the_caller_back() -> None:
    mine = os.sched_getaffinity(0)
    with pytest.raises(RuntimeError), pinned(placements()[-1], []):
        raise RuntimeError("the case failed")
    assert os.sched_getaffinity(0) == mine
