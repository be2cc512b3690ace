"""etcd paused (SIGSTOP) longer than the lease TTL, then resumed (issue 22, defect 9): every
lease has expired, the node keys are deleted, the nodes register again. A client reading all
the while keeps both nodes in its view (the grace period) and loses no hit to membership."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from etcd_fixture import EtcdServer
from kvtest import byte_namespace, payload_for, wait_for
from node_process import NodeProcess

from kvpool.cluster.etcd_membership import EtcdMembership, list_nodes
from kvpool.cluster.membership import NodeInfo
from kvpool.config import ClusterConfig
from kvpool.net.client import ClusterClient, membership_for

CHUNK = 16 * 1024
TTL = 2.0
NS = byte_namespace(CHUNK, salt="etcd-pause")


@pytest.fixture
def two_nodes(tmp_path: Path, etcd_server: EtcdServer,
              cluster_name: str) -> Iterator[list[NodeProcess]]:
    cluster = {"etcd": [etcd_server.endpoint], "name": cluster_name, "lease_ttl_s": TTL}
    procs = [NodeProcess(tmp_path / f"n{i}", cluster=cluster, server={"node_id": f"node-{i}"})
             for i in range(2)]
    for proc in procs:
        proc.start()
    yield procs
    for proc in procs:
        proc.stop()


def test_etcd_paused_past_the_ttl_costs_no_hits_and_never_empties_the_view(
        two_nodes: list[NodeProcess], etcd_server: EtcdServer, cluster_name: str) -> None:
    ep = [etcd_server.endpoint]
    cfg = ClusterConfig(etcd=ep, name=cluster_name, replicas=1, lease_ttl_s=TTL,
                        request_timeout_s=2.0)
    # Every view the client's membership publishes (each change), and every view of a plain
    # watcher without a grace period (it sees the keys go and come back, as etcd has them).
    client_views: list[int] = []
    etcd_views: list[int] = []

    def counter(views: list[int]) -> Callable[[list[NodeInfo]], None]:
        return lambda nodes: views.append(len(nodes))

    membership = membership_for(cfg)
    membership._on_change = counter(client_views)  # type: ignore[attr-defined]
    client = ClusterClient(cfg, membership=membership)
    deletes = EtcdMembership(ep, cluster_name, on_change=counter(etcd_views))
    stop = threading.Event()
    fewest = [2]
    counts = {"reads": 0, "misses": 0}
    errors: list[BaseException] = []
    try:
        wait_for(lambda: len(client.live_nodes()) == 2, 10, "2 nodes")
        client.register_namespace(NS)
        keys = [os.urandom(16) for _ in range(40)]
        assert client.put_many([(k, NS, payload_for(k, CHUNK)) for k in keys]) == 40
        outs = [np.zeros(CHUNK, np.uint8) for _ in keys]

        def reader() -> None:
            try:
                while not stop.is_set():
                    fewest[0] = min(fewest[0], len(client.live_nodes()))
                    hits = client.get_many_into(NS, keys, outs)
                    counts["reads"] += 1
                    counts["misses"] += hits.count(False)
                    time.sleep(0.01)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=reader)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        assert etcd_server.proc is not None
        etcd_server.proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(TTL + 2.5)
        finally:
            etcd_server.proc.send_signal(signal.SIGCONT)
        # The nodes find their leases gone and register again.
        wait_for(lambda: len(list_nodes(ep, cluster_name)) == 2, 15, "both nodes back in etcd")
        wait_for(lambda: len(deletes.live_nodes()) == 2, 10, "the plain watcher agrees")
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(30)
        assert not errors, errors
        assert etcd_views and min(etcd_views) < 2, \
            f"etcd did not drop the keys: the pause did not outlive the TTL ({etcd_views})"
        assert counts["reads"] > 10
        assert fewest[0] == 2, f"the client's view fell to {fewest[0]} node(s)"
        assert all(n == 2 for n in client_views), f"client views: {client_views}"
        assert counts["misses"] == 0
    finally:
        stop.set()
        if etcd_server.proc is not None:
            etcd_server.proc.send_signal(signal.SIGCONT)
        deletes.close()
        client.close()
