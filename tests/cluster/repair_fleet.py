"""Helpers for the repair tests: real ``kvpool serve`` nodes ``node-0``.. in one etcd cluster,
all from the same cluster settings (the replication factor included, as the nodes' repair
reads it), restarted (optionally wiped) by id, and probed node by node."""

from __future__ import annotations

import shutil
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from kvtest import payload_for, wait_for
from node_process import NodeProcess

from kvpool.config import ClusterConfig
from kvpool.keys import Namespace
from kvpool.net.client import ClusterClient
from kvpool.net.connection import NodeConnection


class Fleet:
    def __init__(self, base: Path, etcd: str, cluster_name: str, count: int, *,
                 replicas: int = 2, **sections: Any) -> None:
        self.cluster_settings: dict[str, Any] = {
            "etcd": [etcd], "name": cluster_name, "lease_ttl_s": 2, "replicas": replicas,
            "repair_delay_s": 0.5, "repair_bytes_per_s": "512MiB",
            **sections.pop("cluster", {})}
        server = {"metrics_port": 0, **sections.pop("server", {})}
        self.procs: dict[str, NodeProcess] = {}
        for i in range(count):
            node_id = f"node-{i}"
            self.procs[node_id] = NodeProcess(base / node_id,
                                              server={**server, "node_id": node_id},
                                              cluster=dict(self.cluster_settings), **sections)

    def start(self) -> Fleet:
        for proc in self.procs.values():
            proc.start()
        return self

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.stop()

    def client(self, *namespaces: Namespace, **kw: Any) -> ClusterClient:
        s = self.cluster_settings
        # The nodes' lease TTL, so a vanished node leaves the view after the same grace
        # (cluster.membership_grace_s: 2 x lease_ttl_s) a client of this fleet would give it.
        c = ClusterClient(ClusterConfig(etcd=s["etcd"], name=s["name"], replicas=s["replicas"],
                                        lease_ttl_s=s["lease_ttl_s"],
                                        token=s.get("token"), retry_down_s=0.3,
                                        request_timeout_s=5.0, **kw))
        self.wait_live(c, set(self.procs))
        for ns in namespaces:
            c.register_namespace(ns)
        return c

    @staticmethod
    def wait_live(c: ClusterClient, ids: set[str], timeout_s: float = 15) -> None:
        wait_for(lambda: set(c.live_nodes()) == ids, timeout_s, f"live nodes {sorted(ids)}")

    def restart(self, node_id: str, *, wipe: bool = False) -> None:
        """SIGTERM, (wipe its cache dir), start again on the same port."""
        proc = self.procs[node_id]
        assert proc.terminate() == 0
        if wipe:
            shutil.rmtree(proc.base / "cache")
        proc.start()

    def holds(self, node_id: str, ns: Namespace, keys: list[bytes]) -> list[bool]:
        """What the node holds of ``keys``, asked directly (EXISTS)."""
        conn = NodeConnection(self.procs[node_id].address, self.cluster_settings.get("token"))
        try:
            return conn.exists(ns, keys)
        finally:
            conn.close()

    def metric(self, node_id: str, line_prefix: str) -> float:
        port = self.procs[node_id].metrics_port
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) \
            .read().decode()
        return sum(float(ln.split()[-1]) for ln in text.splitlines()
                   if ln.startswith(line_prefix))


def put_all(c: ClusterClient, ns: Namespace, keys: list[bytes]) -> None:
    assert c.put_many([(k, ns, payload_for(k, ns.chunk_bytes)) for k in keys]) == len(keys)


def read_hits(c: ClusterClient, ns: Namespace, keys: list[bytes]) -> tuple[int, int]:
    """(hits, hits with wrong bytes) of one batched read of ``keys``."""
    outs = [np.zeros(ns.chunk_bytes, np.uint8) for _ in keys]
    found = c.get_many_into(ns, keys, outs)
    wrong = sum(1 for k, o, hit in zip(keys, outs, found, strict=True)
                if hit and not np.array_equal(o, payload_for(k, ns.chunk_bytes)))
    return sum(found), wrong
