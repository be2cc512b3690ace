"""Node identity in etcd (issue 22, defect 1): a second node with a taken node id is refused and
never touches the first's key; a node's own restart takes its key back; clients drop the state
of an old incarnation; a node that lost its key to another stops. Real etcd, real `kvpool
serve` processes."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from kvtest import byte_namespace, payload_for, wait_for
from node_process import NodeProcess

from kvpool.cluster import membership, registration
from kvpool.cluster.etcd import EtcdClient
from kvpool.cluster.membership import NodeInfo, registration_key
from kvpool.config import ClusterConfig
from kvpool.net.client import ClusterClient

CHUNK = 16 * 1024
NS = byte_namespace(CHUNK, salt="identity-test")


def record(etcd: str, cluster: str, node_id: str) -> tuple[NodeInfo, int] | None:
    """The node's record in etcd and its mod_revision, or None."""
    kv = EtcdClient([etcd]).get(registration_key(cluster, node_id))
    return None if kv is None else (NodeInfo.from_json(kv.value), kv.mod_revision)


def test_a_duplicate_node_id_is_refused_and_the_original_keeps_its_key(
        tmp_path: Path, etcd_endpoint: str, cluster_name: str) -> None:
    cluster = {"etcd": [etcd_endpoint], "name": cluster_name, "lease_ttl_s": 2.0}
    with NodeProcess(tmp_path / "first", cluster=cluster, server={"node_id": "node-1"}) as first:
        before = record(etcd_endpoint, cluster_name, "node-1")
        assert before is not None and before[0].address() == first.address
        dup = NodeProcess(tmp_path / "dup", cluster=cluster, server={"node_id": "node-1"})
        with pytest.raises(RuntimeError, match=r"exited \(2\)"):
            dup.start()
        lines = dup.log.read_text().splitlines()  # its stderr: the one line, nothing else
        assert len(lines) == 1 and lines[0].startswith("kvpool serve: "), lines
        assert "node id node-1 is taken by the node at " + first.address in lines[0]
        assert "Traceback" not in dup.log.read_text()
        # The original's record was not touched, and it stays registered (its lease is kept).
        assert record(etcd_endpoint, cluster_name, "node-1") == before
        threading.Event().wait(2.5)  # past the TTL: the key is being kept alive by the first
        assert record(etcd_endpoint, cluster_name, "node-1") == before
        assert first.alive()


def test_a_node_killed_before_its_ttl_restarts_on_its_cache_dir_and_clients_see_the_new_run(
        tmp_path: Path, etcd_endpoint: str, cluster_name: str) -> None:
    """kill -9 leaves the key (30 s TTL); the restart on the same cache_dir is the same
    identity, so it takes the key over at once with a new incarnation. A client that marked
    the dead run down (retry in 60 s) drops that mark when it sees the new run."""
    cluster = {"etcd": [etcd_endpoint], "name": cluster_name, "lease_ttl_s": 30.0}
    node = NodeProcess(tmp_path / "n", cluster=cluster, server={"node_id": "node-r"},
                       ssd={"durability": "durable"})  # an acknowledged put survives kill -9
    node.start()
    client = ClusterClient(ClusterConfig(etcd=[etcd_endpoint], name=cluster_name,
                                         retry_down_s=60.0, request_timeout_s=2.0,
                                         lease_ttl_s=30.0))
    try:
        wait_for(lambda: client.live_nodes() == ["node-r"], 10, "the node registered")
        client.register_namespace(NS)
        first = record(etcd_endpoint, cluster_name, "node-r")
        assert first is not None
        keys = [bytes([i]) * 16 for i in range(8)]
        assert client.put_many([(k, NS, payload_for(k, CHUNK)) for k in keys]) == 8
        node.kill9()
        outs = [np.zeros(CHUNK, np.uint8) for _ in keys]
        assert client.get_many_into(NS, keys, outs) == [False] * 8  # a miss, marked down
        assert client.live_nodes() == []
        node.start()  # within the TTL: the old key is still there
        wait_for(lambda: client.live_nodes() == ["node-r"], 10,
                 "the client to take the new incarnation (not wait out retry_down_s)")
        second = record(etcd_endpoint, cluster_name, "node-r")
        assert second is not None
        assert second[0].identity == first[0].identity
        assert second[0].incarnation != first[0].incarnation
        assert client.get_many_into(NS, keys, outs) == [True] * 8
        assert all(np.array_equal(o, payload_for(k, CHUNK)) for k, o in zip(keys, outs,
                                                                             strict=True))
    finally:
        client.close()
        node.stop()


def test_registration_never_overwrites_or_deletes_another_identitys_key(
        etcd_endpoint: str, cluster_name: str) -> None:
    """At the registration level: a second identity is refused at start; a node that loses
    its lease while another identity holds the key does not take it back (on_taken is
    called); a node whose key was replaced under it leaves that key alone when it stops."""
    etcd = EtcdClient([etcd_endpoint])
    key = registration_key(cluster_name, "node-x")
    taken: list[registration.NodeIdTakenError] = []
    a = registration.NodeRegistration([etcd_endpoint], cluster_name,
                         NodeInfo("node-x", "127.0.0.1", 7101, identity="a" * 32), ttl_s=1.5,
                         on_taken=taken.append).start()
    b = registration.NodeRegistration([etcd_endpoint], cluster_name,
                         NodeInfo("node-x", "127.0.0.1", 7102, identity="b" * 32), ttl_s=30)
    with pytest.raises(registration.NodeIdTakenError,
                       match=r"taken by the node at 127\.0\.0\.1:7101"):
        b.start()
    b.close()
    kv = etcd.get(key)
    assert kv is not None and NodeInfo.from_json(kv.value).port == 7101
    assert etcd.get(membership.expected_key(cluster_name, "node-x")) is not None

    # Another identity's record replaces a's, then a's lease is lost: a must not take it back.
    other = NodeInfo("node-x", "127.0.0.1", 7104, incarnation="1", identity="c" * 32)
    etcd.put(key, other.to_json())
    lease = a.lease_id
    assert lease is not None and etcd.lease_revoke(lease)
    wait_for(lambda: bool(taken), 10, "a to find its key held by another identity")
    assert taken[0].holder == other
    a.close()
    assert etcd.get(key) is not None and NodeInfo.from_json(etcd.get(key).value) == other

    # A registered node whose key was replaced under it (lease kept) stops without deleting.
    etcd.delete(key)
    d = registration.NodeRegistration([etcd_endpoint], cluster_name,
                         NodeInfo("node-x", "127.0.0.1", 7105, identity="d" * 32)).start()
    etcd.put(key, other.to_json())
    d.close()
    kv = etcd.get(key)
    assert kv is not None and NodeInfo.from_json(kv.value) == other
    etcd.delete(key)


def test_a_node_whose_key_another_node_holds_after_a_lost_lease_stops_with_exit_2(
        tmp_path: Path, etcd_endpoint: str, cluster_name: str) -> None:
    """The node loses its lease while another identity's record sits at its key: it logs one
    ERROR (event node_id_taken) naming the holder and `kvpool serve` exits 2, leaving the
    other's record as it was."""
    cluster = {"etcd": [etcd_endpoint], "name": cluster_name, "lease_ttl_s": 2.0}
    node = NodeProcess(tmp_path / "n", cluster=cluster, server={"node_id": "node-t"})
    node.start()
    try:
        etcd = EtcdClient([etcd_endpoint])
        key = registration_key(cluster_name, "node-t")
        kv = etcd.get(key)
        assert kv is not None and kv.lease
        other = NodeInfo("node-t", "127.0.0.1", 7999, incarnation="1", identity="e" * 32)
        etcd.put(key, other.to_json())  # another node took the key (without a lease here)
        assert etcd.lease_revoke(kv.lease)  # and the node's lease is gone
        assert node.proc is not None
        assert node.proc.wait(20) == 2
        log = node.log.read_text()
        errors = [ln for ln in log.splitlines() if " ERROR " in ln]
        assert len(errors) == 1 and "127.0.0.1:7999" in errors[0], errors
        assert "Traceback" not in log
        kv = etcd.get(key)
        assert kv is not None and NodeInfo.from_json(kv.value) == other
        etcd.delete(key)
    finally:
        node.stop()


def test_two_nodes_on_one_cache_dir_are_refused_even_with_their_own_ssd_paths(
        tmp_path: Path, etcd_endpoint: str, cluster_name: str) -> None:
    """The identity lives in the cache_dir: a second node there (its SSD elsewhere, so the SSD
    lock does not stop it) would pass for the first's earlier run; it is refused (exit 2)."""
    cluster = {"etcd": [etcd_endpoint], "name": cluster_name, "lease_ttl_s": 2.0}
    shared = str(tmp_path / "shared")
    with NodeProcess(tmp_path / "first", cluster=cluster, cache_dir=shared,
                     ssd={"path": str(tmp_path / "ssd1")}, server={"node_id": "node-s"}):
        before = record(etcd_endpoint, cluster_name, "node-s")
        second = NodeProcess(tmp_path / "second", cluster=cluster, cache_dir=shared,
                             ssd={"path": str(tmp_path / "ssd2")}, server={"node_id": "node-s"})
        with pytest.raises(RuntimeError, match=r"exited \(2\)"):
            second.start()
        lines = second.log.read_text().splitlines()
        assert len(lines) == 1 and "node-identity.lock is held by another running node" \
            in lines[0], lines
        assert record(etcd_endpoint, cluster_name, "node-s") == before
