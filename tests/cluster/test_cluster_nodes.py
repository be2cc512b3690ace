"""Three real ``kvpool serve`` nodes registered in a real etcd: placement, replicas, kill -9
under load, re-registration after restart."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from kvtest import byte_namespace, payload_for, wait_for
from node_process import NodeProcess

from kvpool.cluster.etcd_membership import EtcdMembership
from kvpool.config import ClusterConfig
from kvpool.net.client import ClusterClient
from kvpool.net.connection import NodeConnection
from kvpool.net.placement import replicas

CHUNK = 64 * 1024
TTL = 2.0
NS = byte_namespace(CHUNK, salt="cluster-test")




@pytest.fixture
def nodes(tmp_path: Path, etcd_endpoint: str, cluster_name: str) -> Iterator[list[NodeProcess]]:
    cluster = {"etcd": [etcd_endpoint], "name": cluster_name, "lease_ttl_s": TTL}
    procs = [NodeProcess(tmp_path / f"node{i}", cluster=cluster,
                         server={"node_id": f"node-{i}"}) for i in range(3)]
    for proc in procs:
        proc.start()
    yield procs
    for proc in procs:
        proc.stop()


def client(etcd_endpoint: str, cluster_name: str, **kw: object) -> ClusterClient:
    cfg = ClusterConfig(etcd=[etcd_endpoint], name=cluster_name, replicas=2,
                        retry_down_s=0.5, request_timeout_s=2.0, **kw)  # type: ignore[arg-type]
    c = ClusterClient(cfg)
    wait_for(lambda: len(c.live_nodes()) == 3, 10, "3 registered nodes")
    c.register_namespace(NS)
    return c


def holders(procs: list[NodeProcess], key: bytes) -> set[str]:
    """Which nodes hold ``key``, asked of each node directly."""
    out = set()
    for i, proc in enumerate(procs):
        conn = NodeConnection(proc.address)
        if conn.exists_prefix(NS, [key]) == 1:
            out.add(f"node-{i}")
        conn.close()
    return out


def test_chunks_land_on_the_replicas_hrw_names(nodes: list[NodeProcess], etcd_endpoint: str,
                                               cluster_name: str) -> None:
    writer = client(etcd_endpoint, cluster_name)
    keys = [os.urandom(16) for _ in range(60)]
    assert writer.put_many([(k, NS, payload_for(k, CHUNK)) for k in keys]) == 60
    expected = replicas(["node-0", "node-1", "node-2"], keys, 2)
    for key, want in zip(keys, expected, strict=True):
        assert holders(nodes, key) == set(want)
    assert len({frozenset(w) for w in expected}) == 3  # all three pairs are used
    reader = client(etcd_endpoint, cluster_name)  # another inference node
    assert reader.exists_prefix(NS, keys) == 60
    outs = [np.zeros(CHUNK, np.uint8) for _ in keys]
    assert reader.get_many_into(NS, keys, outs) == [True] * 60
    for key, out in zip(keys, outs, strict=True):
        assert np.array_equal(out, payload_for(key, CHUNK))
    writer.close()
    reader.close()


def test_kill9_under_load_costs_misses_never_errors_or_wrong_bytes(
        nodes: list[NodeProcess], etcd_endpoint: str, cluster_name: str) -> None:
    c = client(etcd_endpoint, cluster_name)
    before = [os.urandom(16) for _ in range(80)]
    assert c.put_many([(k, NS, payload_for(k, CHUNK)) for k in before]) == 80
    errors: list[BaseException] = []
    wrong: list[bytes] = []
    counts = {"hits": 0, "misses": 0, "puts": 0}
    stop = threading.Event()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        out = np.zeros(CHUNK, np.uint8)
        try:
            while not stop.is_set():
                if rng.random() < 0.3:
                    key = os.urandom(16)
                    counts["puts"] += c.put_many([(key, NS, payload_for(key, CHUNK))])
                    continue
                key = rng.choice(before)
                if c.get_many_into(NS, [key], [out])[0]:
                    counts["hits"] += 1
                    if not np.array_equal(out, payload_for(key, CHUNK)):
                        wrong.append(key)
                else:
                    counts["misses"] += 1
                c.exists_prefix(NS, rng.sample(before, 8))
        except BaseException as exc:  # any exception reaching the caller fails the test
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    victim = nodes[1]
    victim.kill9()
    killed_at = time.monotonic()
    watcher = EtcdMembership([etcd_endpoint], cluster_name)
    wait_for(lambda: "node-1" not in {n.node_id for n in watcher.live_nodes()}, TTL + 5,
             "the dead node to leave membership")
    left_after = time.monotonic() - killed_at
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert not wrong
    assert counts["hits"] > 0 and counts["puts"] > 0
    assert left_after < TTL + 3
    # Every chunk written before the kill has a live replica: all of them still read.
    outs = [np.zeros(CHUNK, np.uint8) for _ in before]
    assert c.get_many_into(NS, before, outs) == [True] * 80
    # The node comes back on the same port and data dir, re-registers, serves its SSD data.
    victim.start()
    wait_for(lambda: "node-1" in {n.node_id for n in watcher.live_nodes()}, 10,
             "the restarted node to re-register")
    held = [k for k, r in zip(before, replicas(["node-0", "node-1", "node-2"], before, 2),
                              strict=True) if "node-1" in r]
    conn = NodeConnection(victim.address)
    outs = [np.zeros(CHUNK, np.uint8) for _ in held]
    got = conn.get_into(NS, held, outs)
    assert got == [True] * len(held) and len(held) > 10
    for key, out in zip(held, outs, strict=True):
        assert np.array_equal(out, payload_for(key, CHUNK))
    conn.close()
    watcher.close()
    c.close()


def test_admin_nodes_lists_registered_nodes(nodes: list[NodeProcess], etcd_endpoint: str,
                                            cluster_name: str, tmp_path: Path) -> None:
    import json
    import subprocess
    import sys
    cfg = tmp_path / "client.yaml"
    cfg.write_text(f"cluster: {{etcd: ['{etcd_endpoint}'], name: '{cluster_name}'}}\n")
    watcher = EtcdMembership([etcd_endpoint], cluster_name)
    wait_for(lambda: len(watcher.live_nodes()) == 3, 10, "3 registered nodes")
    nodes[2].kill9()
    out = subprocess.run([sys.executable, "-m", "kvpool.cli", "admin", "nodes", "--json",
                          "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    rows = {r["node_id"]: r for r in json.loads(out.stdout)}
    assert set(rows) == {"node-0", "node-1", "node-2"}
    assert rows["node-0"]["up"] and rows["node-1"]["up"]
    assert rows["node-0"]["state"] == rows["node-1"]["state"] == "live"
    assert not rows["node-2"]["up"]  # listed until its lease expires, but shown as down;
    # then missing (it is in the expected set), and the listing exits 1
    assert out.returncode == (1 if rows["node-2"]["state"] == "missing" else 0), out.stderr
    assert rows["node-0"]["address"] == nodes[0].address
    wait_for(lambda: "node-2" not in {n.node_id for n in watcher.live_nodes()}, TTL + 5,
             "node-2's lease to expire")
    table = subprocess.run([sys.executable, "-m", "kvpool.cli", "admin", "nodes", "--config",
                            str(cfg)], capture_output=True, text=True, timeout=60)
    assert table.returncode == 1 and "node-1" in table.stdout and "MISSING" in table.stdout
    assert "node-2" in table.stderr
    watcher.close()
