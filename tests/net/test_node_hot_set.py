"""A real ``kvpool serve`` node keeps a hot set its DRAM serves through SSD turnover and a
restart (SIGTERM, or SIGKILL: the SSD itself keeps it, not only the close)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from kvtest import byte_namespace, payload_for, wait_for
from node_process import NodeProcess

from kvpool.net.connection import NodeConnection

CHUNK = 64 * 1024
HOT = 20


@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
def test_a_node_keeps_its_dram_served_hot_set_through_ssd_turnover_and_a_restart(
        tmp_path: Path, stop: str) -> None:
    """DRAM of 64 chunks, SSD of 8 segments of 1 MiB (~110 records): 20 hot chunks, put two
    a round among 8 cold ones, read every round (served from DRAM) while 480 cold chunks turn
    the SSD over 4 times. On main the SSD dropped them all (0 of 20 after either restart)."""
    node = NodeProcess(tmp_path / "node", dram={"capacity": "4MiB", "slab_size": "1MiB"},
                       ssd={"capacity": "8MiB", "segment_size": "1MiB"})
    ns = byte_namespace(CHUNK, salt="hot-set")
    hot = [os.urandom(16) for _ in range(HOT)]
    outs = [np.zeros(CHUNK, np.uint8) for _ in hot]
    with node:
        conn = NodeConnection(node.address)
        try:
            live: list[bytes] = []

            def read_hot() -> bool:  # True once the SSD's write-behind queue is empty
                assert conn.get_into(ns, live, outs[:len(live)]) == [True] * len(live)
                return conn.stats()["write_behind"]["queued"] == 0

            for r in range(60):
                keys = hot[2 * r:2 * r + 2] + [os.urandom(16) for _ in range(8)]
                assert conn.put(ns, keys, [payload_for(k, CHUNK) for k in keys]) == len(keys)
                live = hot[:2 * r + 2]
                # The SSD keeps up with the puts (on this loaded machine its niced writer
                # may stall, then turn the log over 3 times in 0.15 s, faster than any
                # reader: second chance needs a read per turnover of the log), and a kill -9
                # loses what its queue still holds (cache mode, by design).
                wait_for(read_hot, 60, "the write-behind queue to drain")
            stats = conn.stats()
            assert stats["ssd"]["segments_evicted"] >= 24  # the log turned over 3 times
            assert stats["pool"]["dram_hits"] >= 0.8 * sum(min(2 * r + 2, HOT)
                                                           for r in range(60))
        finally:
            conn.close()
        if stop == "sigterm":
            assert node.terminate() == 0
        else:
            node.kill9()
        node.start()
        conn = NodeConnection(node.address)
        try:
            found = conn.get_into(ns, hot, outs)
        finally:
            conn.close()
    exact = sum(f and np.array_equal(o, payload_for(k, CHUNK))
                for f, o, k in zip(found, outs, hot, strict=True))
    assert exact >= 0.95 * HOT, f"{exact} of {HOT} hot chunks after the restart ({stop})"
