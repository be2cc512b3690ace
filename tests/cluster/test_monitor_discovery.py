"""``kvpool monitor`` without ``--endpoint``: the nodes registered in a real etcd, each at the
``metrics_port`` its record names (a live ``kvpool serve`` registers its own); a node
registered without one, or whose port is dead, is a down row. Static nodes: at the config's
server.metrics_port."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml
from kvtest import child_env
from metrics_endpoint import MetricsEndpoint, dead_address, pool_metrics
from node_process import NodeProcess

from kvpool.cluster.etcd import EtcdClient
from kvpool.cluster.membership import registration_key


def register(etcd: str, cluster: str, node_id: str, metrics: str | None) -> None:
    record: dict[str, object] = {"node_id": node_id, "host": "127.0.0.1", "port": 7000}
    if metrics is not None:
        record["metrics_port"] = int(metrics.rpartition(":")[2])
    EtcdClient([etcd]).put(registration_key(cluster, node_id), json.dumps(record).encode())


def test_default_endpoints_are_the_registered_nodes(tmp_path: Path, etcd_endpoint: str,
                                                    cluster_name: str) -> None:
    cluster = {"etcd": [etcd_endpoint], "name": cluster_name}
    config = tmp_path / "kvpool.yaml"
    config.write_text(yaml.safe_dump({"cluster": cluster}))
    # node-b: a real node, registered by itself with its metrics port; beside it a record
    # whose metrics port is dead and one without a metrics port.
    with NodeProcess(tmp_path / "node", server={"metrics_port": 0, "node_id": "node-b"},
                     cluster=cluster) as node:
        register(etcd_endpoint, cluster_name, "node-a", dead_address())
        register(etcd_endpoint, cluster_name, "node-c", None)
        res = subprocess.run([sys.executable, "-m", "kvpool.cli", "monitor", "--once", "--json",
                              "--interval", "0.2", "--config", str(config)],
                             capture_output=True, text=True, env=child_env(), timeout=60)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert list(doc) == ["node-a", "node-b", "node-c"]
    assert doc["node-b"]["up"] and doc["node-b"]["kind"] == "node"
    assert doc["node-b"]["url"] == f"http://127.0.0.1:{node.metrics_port}/metrics"
    assert doc["node-a"]["up"] is False and "refused" in doc["node-a"]["error"].lower()
    assert doc["node-c"]["up"] is False and "metrics port" in doc["node-c"]["error"]

    # An empty cluster has nothing to watch: exit 2, saying so.
    config.write_text(yaml.safe_dump({"cluster": {"etcd": [etcd_endpoint],
                                                  "name": cluster_name + "-empty"}}))
    res = subprocess.run([sys.executable, "-m", "kvpool.cli", "monitor", "--once",
                          "--config", str(config)],
                         capture_output=True, text=True, env=child_env(), timeout=60)
    assert res.returncode == 2 and "no node is registered" in res.stderr


def test_static_nodes_at_the_configs_metrics_port(tmp_path: Path) -> None:
    with MetricsEndpoint(pool_metrics().registry) as endpoint:
        port = int(endpoint.address.rpartition(":")[2])
        config = tmp_path / "kvpool.yaml"
        config.write_text(yaml.safe_dump({"cluster": {"nodes": ["127.0.0.1:7000"]},
                                          "server": {"metrics_port": port}}))
        res = subprocess.run([sys.executable, "-m", "kvpool.cli", "monitor", "--once", "--json",
                              "--interval", "0.2", "--config", str(config)],
                             capture_output=True, text=True, env=child_env(), timeout=60)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["127.0.0.1:7000"]["url"] == \
        f"http://127.0.0.1:{port}/metrics"
