"""`kvpool admin stats / invalidate / drain / undrain` against three real `kvpool serve` nodes
registered in a real etcd, run as the operator runs them (child processes of the CLI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from kvtest import byte_namespace, child_env, payload_for, wait_for
from node_process import NodeProcess

from kvpool.cluster.etcd import EtcdClient
from kvpool.cluster.membership import StaticMembership, drained_key
from kvpool.config import ClusterConfig
from kvpool.keys import Namespace
from kvpool.net.client import ClusterClient
from kvpool.net.connection import NodeConnection
from kvpool.net.placement import replicas

CHUNK = 16 * 1024
IDS = ["node-0", "node-1", "node-2"]




@pytest.fixture
def nodes(tmp_path: Path, etcd_endpoint: str,
          cluster_name: str) -> Iterator[dict[str, NodeProcess]]:
    cluster = {"etcd": [etcd_endpoint], "name": cluster_name, "lease_ttl_s": 2.0}
    procs = {n: NodeProcess(tmp_path / n, cluster=cluster, server={"node_id": n, "metrics_port": 0})
             for n in IDS}
    for proc in procs.values():
        proc.start()
    yield procs
    for proc in procs.values():
        proc.stop()


@pytest.fixture
def config(tmp_path: Path, etcd_endpoint: str, cluster_name: str) -> Path:
    path = tmp_path / "admin.yaml"
    path.write_text(f"cluster: {{etcd: ['{etcd_endpoint}'], name: '{cluster_name}'}}\n")
    return path


def admin(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, "-m", "kvpool.cli", "admin", *args, "--config",
                          str(config)], capture_output=True, text=True, timeout=60,
                         env=child_env())
    assert "Traceback" not in out.stderr, out.stderr
    return out


def client(etcd_endpoint: str, cluster_name: str, *namespaces: Namespace) -> ClusterClient:
    c = ClusterClient(ClusterConfig(etcd=[etcd_endpoint], name=cluster_name, replicas=1,
                                    retry_down_s=0.5, request_timeout_s=5.0))
    wait_for(lambda: len(c.live_nodes()) == 3, 10, "3 registered nodes")
    for ns in namespaces:
        c.register_namespace(ns)
    return c


def put(c: ClusterClient, ns: Namespace, keys: list[bytes]) -> None:
    assert c.put_many([(k, ns, payload_for(k, CHUNK)) for k in keys]) == len(keys)


def read_all(c: ClusterClient, ns: Namespace, keys: list[bytes]) -> bool:
    outs = [np.zeros(CHUNK, np.uint8) for _ in keys]
    hits = c.get_many_into(ns, keys, outs)
    return all(hits) and all(np.array_equal(o, payload_for(k, CHUNK))
                             for k, o in zip(keys, outs, strict=True))


def draining_gauge(proc: NodeProcess) -> float:
    """kvpool_server_draining as the node's /metrics serves it."""
    with urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics") as answer:
        text = answer.read().decode()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("kvpool_server_draining ")]
    return float(line.split()[1])


def held_by(proc: NodeProcess, ns: Namespace, keys: list[bytes]) -> list[bytes]:
    conn = NodeConnection(proc.address)
    try:
        return [k for k, held in zip(keys, conn.exists(ns, keys), strict=True) if held]
    finally:
        conn.close()


def test_stats_as_json_and_as_a_table(nodes: dict[str, NodeProcess], config: Path) -> None:
    every = admin(config, "stats", "--json")
    assert every.returncode == 0, every.stderr
    doc = json.loads(every.stdout)
    assert set(doc) == set(IDS)
    for node_id, stats in doc.items():
        assert stats["server"]["node_id"] == node_id and stats["server"]["draining"] is False
        assert "dram" in stats and "ssd" in stats and stats["namespaces"] == []
    one = admin(config, "stats", "--node", "node-1", "--json")
    assert one.returncode == 0 and list(json.loads(one.stdout)) == ["node-1"]
    table = admin(config, "stats")
    assert table.returncode == 0
    assert all(n in table.stdout for n in IDS) and "server.uptime_s" in table.stdout
    nowhere = admin(config, "stats", "--node", "node-9")
    assert nowhere.returncode == 1 and "node-9" in nowhere.stderr
    assert nowhere.stderr.count("\n") == 1


def test_invalidate_by_id_and_by_model_drops_exactly_those_namespaces(
        nodes: dict[str, NodeProcess], config: Path, etcd_endpoint: str,
        cluster_name: str) -> None:
    by_id = byte_namespace(CHUNK, model="model-a", salt="t1")
    by_model = byte_namespace(CHUNK, model="model-b", salt="t1")
    other_tenant = byte_namespace(CHUNK, model="model-b", salt="t2")
    kept = byte_namespace(CHUNK, model="model-c", salt="t1")
    spaces = (by_id, by_model, other_tenant, kept)
    c = client(etcd_endpoint, cluster_name, *spaces)
    keys = [os.urandom(16) for _ in range(24)]
    for ns in spaces:
        put(c, ns, keys)
    out = admin(config, "invalidate", by_id.id.hex())
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) == 3  # one line per node
    assert c.exists_prefix(by_id, keys) == 0
    assert all(c.exists_prefix(ns, keys) == 24 for ns in spaces[1:])
    out = admin(config, "invalidate", "--model", "model-b", "--tenant", "t1", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["invalidated"]
    assert {r["namespace"] for r in rows} == {by_model.id.hex()}
    assert {r["node_id"] for r in rows} == set(IDS)
    assert sum(r["dropped"] for r in rows) >= 24  # copies: DRAM and SSD each count
    assert c.exists_prefix(by_model, keys) == 0
    assert c.exists_prefix(other_tenant, keys) == 24 and c.exists_prefix(kept, keys) == 24
    assert read_all(c, kept, keys)
    none = admin(config, "invalidate", "--model", "model-z")
    assert none.returncode == 1 and "model-z" in none.stderr
    bad = admin(config, "invalidate", "abc")
    assert bad.returncode == 2 and "32 hex digits" in bad.stderr
    both = admin(config, "invalidate", by_id.id.hex(), "--model", "model-b")
    assert both.returncode == 2
    c.close()


def test_drain_stops_new_puts_landing_while_reads_still_hit_and_undrain_restores(
        nodes: dict[str, NodeProcess], config: Path, etcd_endpoint: str,
        cluster_name: str) -> None:
    ns = byte_namespace(CHUNK, salt="drain")
    c = client(etcd_endpoint, cluster_name, ns)
    before = [os.urandom(16) for _ in range(60)]
    put(c, ns, before)
    on_node0 = held_by(nodes["node-0"], ns, before)
    assert on_node0 == [k for k, r in zip(before, replicas(IDS, before, 1), strict=True)
                        if r == ["node-0"]] and on_node0

    out = admin(config, "drain", "node-0")
    assert out.returncode == 0, out.stderr
    wait_for(lambda: c.drained_nodes() == {"node-0"}, 10, "the client sees the drain")
    conn = NodeConnection(nodes["node-0"].address)
    wait_for(lambda: conn.stats()["server"]["draining"] is True, 10, "the node sees it")
    assert draining_gauge(nodes["node-0"]) == 1 and draining_gauge(nodes["node-1"]) == 0
    during = [os.urandom(16) for _ in range(60)]
    put(c, ns, during)
    assert held_by(nodes["node-0"], ns, during) == []  # nothing new landed there
    assert read_all(c, ns, before)  # what it held still hits, from it
    assert read_all(c, ns, during)  # the new chunks were placed on the others
    assert c.exists_prefix(ns, before + during) == 120
    listing = json.loads(admin(config, "nodes", "--json").stdout)
    assert {r["node_id"]: r["drained"] for r in listing} == \
        {"node-0": True, "node-1": False, "node-2": False}

    out = admin(config, "undrain", "node-0")
    assert out.returncode == 0 and "undrained" in out.stdout
    wait_for(lambda: c.drained_nodes() == frozenset(), 10, "the client sees the undrain")
    wait_for(lambda: conn.stats()["server"]["draining"] is False, 10, "the node sees it")
    assert draining_gauge(nodes["node-0"]) == 0
    after = [os.urandom(16) for _ in range(60)]
    put(c, ns, after)
    assert held_by(nodes["node-0"], ns, after) == \
        [k for k, r in zip(after, replicas(IDS, after, 1), strict=True) if r == ["node-0"]]
    assert admin(config, "undrain", "node-0").stdout.strip() == "node node-0 was not drained"
    conn.close()
    c.close()


def test_drain_refuses_a_static_list_and_an_unknown_node(
        nodes: dict[str, NodeProcess], config: Path, tmp_path: Path, etcd_endpoint: str,
        cluster_name: str) -> None:
    static = tmp_path / "static.yaml"
    static.write_text(f"cluster: {{nodes: ['{nodes['node-0'].address}']}}\n")
    out = admin(static, "drain", nodes["node-0"].address)
    assert out.returncode == 2 and "needs etcd" in out.stderr
    assert out.stderr.count("\n") == 1
    assert admin(static, "undrain", nodes["node-0"].address).returncode == 2
    unknown = admin(config, "drain", "node-7")
    assert unknown.returncode == 1 and "not registered" in unknown.stderr
    forced = admin(config, "drain", "node-7", "--force")
    assert forced.returncode == 0
    etcd = EtcdClient([etcd_endpoint])
    assert etcd.get(drained_key(cluster_name, "node-7")) is not None
    assert admin(config, "undrain", "node-7").returncode == 0
    assert etcd.get(drained_key(cluster_name, "node-7")) is None


class _Drained(StaticMembership):
    """A static list with one node drained (only etcd drains for real; placement is what is
    under test here)."""

    def drained_nodes(self) -> frozenset[str]:
        return frozenset({"10.0.0.1:7000"})


def test_with_two_replicas_reads_keep_the_drained_node_and_writes_skip_it() -> None:
    addresses = ["10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000", "10.0.0.4:7000"]
    c = ClusterClient(ClusterConfig(nodes=addresses, replicas=2), _Drained(addresses))
    ns = byte_namespace(CHUNK)
    keys = [os.urandom(16) for _ in range(200)]
    full = replicas(addresses, keys, 4)  # every node, best first
    undrained = [[n for n in ranked if n != "10.0.0.1:7000"] for ranked in full]
    assert c._write_placement(ns, keys) == [u[:2] for u in undrained]
    reads = c._placement(ns, keys)
    for ranked, read in zip(full, reads, strict=True):
        # down to the second undrained node: the drained one too where it ranks above that
        cut = max(ranked.index(n) for n in [m for m in ranked if m != "10.0.0.1:7000"][:2])
        assert read == ranked[:cut + 1]
    assert any("10.0.0.1:7000" in r for r in reads) and any(len(r) == 3 for r in reads)
    c.close()
