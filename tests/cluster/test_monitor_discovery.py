"""``kvpool monitor`` without ``--endpoint``: the nodes registered in a real etcd, each at the
``metrics_port`` its record names; a node registered without one, or whose port is dead, is a
down row."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml
from kvtest import child_env
from metrics_endpoint import MetricsEndpoint, dead_address, pool_metrics

from kvpool.cluster.etcd import EtcdClient
from kvpool.cluster.membership import registration_key


def register(etcd: str, cluster: str, node_id: str, metrics: str | None) -> None:
    record: dict[str, object] = {"node_id": node_id, "host": "127.0.0.1", "port": 7000}
    if metrics is not None:
        record["metrics_port"] = int(metrics.rpartition(":")[2])
    EtcdClient([etcd]).put(registration_key(cluster, node_id), json.dumps(record).encode())


def test_default_endpoints_are_the_registered_nodes(tmp_path: Path, etcd_endpoint: str,
                                                    cluster_name: str) -> None:
    metrics = pool_metrics()
    metrics.hit_chunks.labels("dram").inc(2)
    metrics.miss_chunks.inc(2)
    config = tmp_path / "kvpool.yaml"
    config.write_text(yaml.safe_dump({"cluster": {"etcd": [etcd_endpoint],
                                                  "name": cluster_name}}))
    with MetricsEndpoint(metrics.registry) as endpoint:
        register(etcd_endpoint, cluster_name, "node-b", endpoint.address)
        register(etcd_endpoint, cluster_name, "node-a", dead_address())
        register(etcd_endpoint, cluster_name, "node-c", None)
        res = subprocess.run([sys.executable, "-m", "kvpool.cli", "monitor", "--once", "--json",
                              "--interval", "0.2", "--config", str(config)],
                             capture_output=True, text=True, env=child_env(), timeout=60)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert list(doc) == ["node-a", "node-b", "node-c"]
    assert doc["node-b"]["up"] and doc["node-b"]["url"] == f"http://{endpoint.address}/metrics"
    assert doc["node-b"]["overall"]["hit_rate_since_start"] == 0.5
    assert doc["node-a"]["up"] is False and "refused" in doc["node-a"]["error"].lower()
    assert doc["node-c"]["up"] is False and "metrics port" in doc["node-c"]["error"]

    # An empty cluster has nothing to watch: exit 2, saying so.
    config.write_text(yaml.safe_dump({"cluster": {"etcd": [etcd_endpoint],
                                                  "name": cluster_name + "-empty"}}))
    res = subprocess.run([sys.executable, "-m", "kvpool.cli", "monitor", "--once",
                          "--config", str(config)],
                         capture_output=True, text=True, env=child_env(), timeout=60)
    assert res.returncode == 2 and "no node is registered" in res.stderr
