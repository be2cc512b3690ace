"""Real network partitions (issue 22, "How to test it"): etcd, three ``kvpool serve`` nodes and
a client each in a network namespace of their own (tests/cluster/netns.py), links cut with a
blackhole qdisc (packets dropped silently, as a partitioned network does).

- A node cut from etcd, not from the client, longer than its lease TTL: the client keeps it
  (cluster.membership_grace_s) and every read hits; healed, the node registers again under its
  own id and incarnation.
- The client cut from one node (R=2): reads of that node's chunks are served by the other
  replica, puts land on the remaining ones; healed, read repair gives the node its copies.

etcd paused (SIGSTOP) past the TTL is tests/cluster/test_etcd_pause.py: a namespace adds
nothing there. Needs root and iproute2 (mark ``netns``): fails, never skips, without them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kvtest import child_env, wait_for
from netns import Netlab, NetnsEtcd, netns_unavailable
from netns_client import NetnsClient
from node_process import NodeProcess

from kvpool.net.placement import replicas

pytestmark = pytest.mark.etcd

CHUNK = 16 * 1024
TTL = 2
NODES = ["n0", "n1", "n2"]


@pytest.fixture
def netlab() -> Iterator[Netlab]:
    """etcd, n0..n2 and the client (``cl``) in namespaces of their own, fully meshed."""
    why = netns_unavailable()
    if why is not None:
        pytest.fail(why, pytrace=False)
    lab = Netlab(["etcd", *NODES, "cl"])
    yield lab
    lab.close()


class Cluster:
    """The lab's etcd, nodes and client; everything stopped by :meth:`close`."""

    def __init__(self, lab: Netlab, base: Path, name: str, *, replicas: int,
                 client: dict[str, Any]) -> None:
        self.lab, self.base = lab, base
        self.etcd = NetnsEtcd(base / "etcd", lab, "etcd")
        self.nodes: dict[str, NodeProcess] = {}
        self.client: NetnsClient | None = None
        self.cluster = {"etcd": [self.etcd.endpoint], "name": name, "lease_ttl_s": TTL,
                        "replicas": replicas, "repair_delay_s": 0.5,
                        "repair_bytes_per_s": "512MiB"}
        self.client_cluster = {**self.cluster, "retry_down_s": 0.5, **client}
        for key in ("repair_delay_s", "repair_bytes_per_s"):
            self.client_cluster.pop(key)

    def start(self, salt: str) -> NetnsClient:
        self.etcd.start()
        for node_id in NODES:
            host = self.lab.address(node_id)
            self.nodes[node_id] = NodeProcess(
                self.base / node_id, command_prefix=self.lab.exec_prefix(node_id),
                server={"host": host, "node_id": node_id}, cluster=self.cluster).start()
        self.client = NetnsClient(self.lab.exec_prefix("cl"),
                                  {"cluster": self.client_cluster, "chunk": CHUNK, "salt": salt},
                                  self.base / "client.log", child_env())
        client = self.client
        wait_for(lambda: client.call("live")["live"] == NODES, 20, "the client sees 3 nodes")
        client.call("register")
        return client

    def close(self) -> None:
        self.lab.heal_all()
        if self.client is not None:
            self.client.close()
        for proc in self.nodes.values():
            proc.stop()
        self.etcd.stop()


@pytest.fixture
def cluster_factory(netlab: Netlab, tmp_path: Path,
                    cluster_name: str) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(**kw: Any) -> Cluster:
        try:
            made.append(Cluster(netlab, tmp_path, cluster_name, **kw))
        except RuntimeError as exc:  # etcd missing
            pytest.fail(str(exc), pytrace=False)
        return made[-1]

    yield make
    for cluster in made:
        cluster.close()


def hex_keys(n: int, salt: int) -> list[str]:
    return [(salt * 1_000_003 + i).to_bytes(16, "little").hex() for i in range(n)]


def test_node_cut_from_etcd_keeps_serving_and_registers_again(
        cluster_factory: Callable[..., Cluster]) -> None:
    # One copy per chunk: a client that dropped n0 from its view would miss n0's third.
    cluster = cluster_factory(replicas=1, client={"membership_grace_s": 30.0,
                                                  "request_timeout_s": 2.0})
    client = cluster.start("cut-from-etcd")
    keys = hex_keys(60, 1)
    assert client.call("put", keys=keys)["stored"] == 60
    before = {n[0]: n[2] for n in client.call("etcd_nodes")["nodes"]}
    client.call("reads_start", keys=keys, watch=True)
    time.sleep(0.5)
    cluster.lab.cut("n0", "etcd")
    time.sleep(3 * TTL)  # n0's lease expires in etcd; the client keeps n0 (grace 30 s)
    cluster.lab.heal("n0", "etcd")
    wait_for(lambda: [n[0] for n in client.call("etcd_nodes")["nodes"]] == NODES, 20,
             "n0 registered again")
    time.sleep(1.0)
    seen = client.call("reads_stop")
    after = {n[0]: n[2] for n in client.call("etcd_nodes")["nodes"]}
    print(f"\ncut from etcd: {seen['reads']} reads of 60 chunks, misses {seen['misses']}, "
          f"GET p50 {seen['p50_ms']:.1f} ms p99 {seen['p99_ms']:.1f} ms")
    assert seen["etcd_min"] == 2, \
        f"etcd never dropped n0's key: the cut did not outlive the TTL ({seen})"
    assert not seen["errors"], seen["errors"]
    assert seen["reads"] > 20
    assert seen["min_live"] == 3, "the client dropped n0 while it was cut from etcd only"
    assert (seen["misses"], seen["wrong"]) == (0, 0)
    assert after == before, "n0 came back under another incarnation"
    assert cluster.nodes["n0"].alive()
    log = cluster.nodes["n0"].log.read_text()
    assert "registered again" in log or "registering again" in log
    assert "is taken" not in log
    assert client.call("live")["live"] == NODES


def test_client_cut_from_one_node_reads_the_other_replica_and_repairs_after(
        cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(replicas=2, client={"request_timeout_s": 1.0,
                                                  "connect_timeout_s": 0.5})
    client = cluster.start("cut-client")
    old, new = hex_keys(60, 2), hex_keys(40, 3)
    assert client.call("put", keys=old)["stored"] == 60
    client.call("reads_start", keys=old)
    time.sleep(0.5)
    cluster.lab.cut("cl", "n0")
    # Past request_timeout_s, and one read that met the cut: every connection opened before
    # the cut is closed, so the put meets the cut at connect (a put sent on an open connection
    # would be retransmitted by TCP after the heal, and arrive).
    time.sleep(1.5)
    assert client.call("read", keys=new)["hits"] == 0
    assert client.call("stats")["node_failures"] > 0, "the cut never reached the client"
    start = time.monotonic()
    stored = client.call("put", keys=new)["stored"]  # n0's share goes nowhere
    put_s = time.monotonic() - start
    time.sleep(2.0)
    cluster.lab.heal("cl", "n0")
    time.sleep(2.0)
    seen = client.call("reads_stop")
    print(f"\nclient cut from n0: {seen['reads']} reads of 60 chunks, misses "
          f"{seen['misses']}, GET p50 {seen['p50_ms']:.1f} ms p99 {seen['p99_ms']:.1f} ms "
          f"max {seen['max_ms']:.0f} ms; "
          f"put of 40 during the cut {put_s:.2f} s")
    assert stored == 40
    assert not seen["errors"], seen["errors"]
    assert (seen["misses"], seen["wrong"]) == (0, 0)
    # Every chunk of both sets is read whole; n0's copies of the new set come back, by the
    # hints the puts left (net/read_repair.py) or by read repair (the reads that find n0,
    # their first replica, without them), whichever reaches n0 first.
    keys = [bytes.fromhex(k) for k in new]
    first = [k.hex() for k, r in zip(keys, replicas(NODES, keys, 2), strict=True)
             if r[0] == "n0"]
    second = [k.hex() for k, r in zip(keys, replicas(NODES, keys, 2), strict=True)
              if r[1] == "n0"]
    address = cluster.nodes["n0"].address
    assert first

    def repaired() -> bool:
        assert client.call("read", keys=new) == {"hits": 40, "wrong": 0}
        return all(client.call("exists", address=address, keys=first)["held"])

    wait_for(repaired, 20, "n0's first copies")
    held_second = sum(client.call("exists", address=address, keys=second)["held"])
    print(f"n0 holds {len(first)}/{len(first)} chunks it is first replica of, "
          f"{held_second}/{len(second)} it is second replica of")
    assert client.call("read", keys=old) == {"hits": 60, "wrong": 0}


def test_client_cut_from_one_node_gets_its_second_copies_back(
        cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(replicas=2, client={"request_timeout_s": 1.0,
                                                  "connect_timeout_s": 0.5})
    client = cluster.start("cut-second")
    new = hex_keys(40, 4)
    cluster.lab.cut("cl", "n0")
    # As in the test above: the put must meet the cut at connect.
    time.sleep(1.5)
    assert client.call("read", keys=new)["hits"] == 0
    assert client.call("stats")["node_failures"] > 0
    assert client.call("put", keys=new)["stored"] == 40
    cluster.lab.heal("cl", "n0")
    keys = [bytes.fromhex(k) for k in new]
    second = [k.hex() for k, r in zip(keys, replicas(NODES, keys, 2), strict=True)
              if r[1] == "n0"]
    address = cluster.nodes["n0"].address
    assert second

    def restored() -> bool:
        assert client.call("read", keys=new) == {"hits": 40, "wrong": 0}
        return all(client.call("exists", address=address, keys=second)["held"])

    wait_for(restored, 8, "n0's copies of the chunks it is second replica of")
