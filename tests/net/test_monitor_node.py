"""``kvpool monitor --once --json`` against a live ``kvpool serve`` node (server.metrics_port)
while a client reads from it: the node's DRAM hit rate is the workload's, bytes are read,
requests are served; a dead endpoint beside it is shown down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from kvtest import byte_namespace, child_env, payload_for
from metrics_endpoint import dead_address
from node_process import NodeProcess

from kvpool.config import ClusterConfig
from kvpool.net.client import ClusterClient

CHUNK = 64 * 1024


@pytest.fixture
def metrics_node(tmp_path: Path) -> Iterator[NodeProcess]:
    with NodeProcess(tmp_path / "node", server={"metrics_port": 0}) as node:
        assert node.metrics_port, "the node printed no metrics port"
        yield node


def test_once_json_against_a_live_node(metrics_node: NodeProcess) -> None:
    client = ClusterClient(ClusterConfig(nodes=[metrics_node.address]))
    ns = byte_namespace(CHUNK, salt="monitor")
    client.register_namespace(ns)
    present = [os.urandom(16) for _ in range(8)]
    assert client.put_many([(k, ns, payload_for(k, CHUNK)) for k in present]) == 8
    absent = [os.urandom(16) for _ in range(8)]
    outs = [np.zeros(CHUNK, np.uint8) for _ in range(16)]
    stop = threading.Event()
    rounds = 0
    failures: list[BaseException] = []

    def workload() -> None:  # every GET: 8 chunks the node holds in DRAM, 8 it never had
        nonlocal rounds
        try:
            while not stop.is_set():
                found = client.get_many_into(ns, present + absent, outs)
                assert found == [True] * 8 + [False] * 8
                rounds += 1
        except BaseException as exc:
            failures.append(exc)

    reader = threading.Thread(target=workload, daemon=True)
    reader.start()
    endpoint, dead = f"127.0.0.1:{metrics_node.metrics_port}", dead_address()
    try:
        res = subprocess.run([sys.executable, "-m", "kvpool.cli", "monitor", "--once", "--json",
                              "--interval", "1", "--endpoint", endpoint, "--endpoint", dead],
                             capture_output=True, text=True, env=child_env(), timeout=60)
    finally:
        stop.set()
        reader.join(30)
        client.close()
    assert not failures and rounds > 0 and not reader.is_alive()
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    node = doc[endpoint]
    assert node["up"] and node["kind"] == "node", node
    # Half of every GET hits DRAM; a scrape may land inside one GET's counting, so the
    # interval's ratio is the workload's within what one GET of 16 chunks can move it.
    assert node["overall"]["chunks_asked"] >= 16
    slack = 16 / node["overall"]["chunks_asked"]
    assert node["tiers"]["dram"]["hit_rate"] == pytest.approx(0.5, abs=slack)
    assert node["overall"]["hit_rate"] == pytest.approx(0.5, abs=slack)
    assert node["overall"]["hit_rate_since_start"] == pytest.approx(0.5, abs=0.01)
    assert node["tiers"]["dram"]["read_gbps"] > 0
    assert node["tiers"]["dram"]["get_p99_s"] > 0
    assert node["tiers"]["dram"]["chunks"] == 8
    assert 0 < node["tiers"]["dram"]["used_fraction"] < 1
    assert node["server"]["connections"] >= 1 and node["server"]["requests_per_s"] > 0
    assert node["server"]["request_p99_s"] > 0
    assert doc[dead]["up"] is False and doc[dead]["error"]
