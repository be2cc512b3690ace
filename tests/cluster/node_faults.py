"""Helpers for cluster fault tests: a set of real nodes in one etcd cluster, paused with
SIGSTOP (a hung node: its socket accepts, nothing answers) or killed with SIGKILL, and always
resumed and stopped afterwards."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvtest import stop_process, wait_for
from node_process import NodeProcess

from kvpool.config import ClusterConfig
from kvpool.keys import Namespace
from kvpool.net.client import ClusterClient


def pause(proc: NodeProcess) -> None:
    """SIGSTOP: the node stays registered and its sockets accept, but nothing answers."""
    assert proc.proc is not None
    stop_process(proc.proc.pid)


def resume(proc: NodeProcess) -> None:
    if proc.alive():
        assert proc.proc is not None
        os.kill(proc.proc.pid, signal.SIGCONT)


class NodeSet:
    """Nodes ``node-0``.. of one cluster; ``add()`` starts one more."""

    def __init__(self, base: Path, etcd: str, cluster: str, **sections: Any) -> None:
        self.base, self.etcd, self.cluster, self.sections = base, etcd, cluster, sections
        self.procs: list[NodeProcess] = []

    def add(self) -> NodeProcess:
        i = len(self.procs)
        proc = NodeProcess(self.base / f"node{i}", server={"node_id": f"node-{i}"},
                           cluster={"etcd": [self.etcd], "name": self.cluster,
                                    "lease_ttl_s": 30}, **self.sections)
        self.procs.append(proc)
        return proc.start()

    def ids(self) -> list[str]:
        return [f"node-{i}" for i in range(len(self.procs))]

    def client(self, ns: Namespace, **kw: Any) -> ClusterClient:
        """A replicas=2 client that waits for every node. A node it marks down stays out of
        placement for the rest of the test (retry_down_s), so a paused node costs one
        request timeout, not one per retry."""
        cfg = ClusterConfig(etcd=[self.etcd], name=self.cluster, replicas=2,
                            request_timeout_s=0.5, retry_down_s=60, **kw)
        c = ClusterClient(cfg)
        wait_for(lambda: len(c.live_nodes()) == len(self.procs), 15,
                 f"{len(self.procs)} registered nodes")
        c.register_namespace(ns)
        return c

    def close(self) -> None:
        for proc in self.procs:
            resume(proc)
        for proc in self.procs:
            proc.stop()


@contextmanager
def node_set(base: Path, etcd: str, cluster: str, count: int,
             **sections: Any) -> Iterator[NodeSet]:
    nodes = NodeSet(base, etcd, cluster, **sections)
    try:
        for _ in range(count):
            nodes.add()
        yield nodes
    finally:
        nodes.close()
