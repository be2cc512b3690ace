"""The expected set (issue 22, item 5): a node that registered once and is not registered now is
missing in `kvpool admin nodes` (exit 1), `kvpool monitor --once` (exit 1) and every node's
`kvpool_cluster_nodes{state}` gauge, until it comes back or `kvpool admin forget` removes it.
Real etcd, real `kvpool serve` processes, the CLI run as an operator runs it."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

from kvtest import child_env, wait_for
from node_process import NodeProcess

from kvpool.cluster.etcd import EtcdClient
from kvpool.cluster.membership import drained_key


def kvpool(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, "-m", "kvpool.cli", *args, "--config", str(config)],
                         capture_output=True, text=True, timeout=60, env=child_env())
    assert "Traceback" not in out.stderr, out.stderr
    return out


def cluster_gauge(proc: NodeProcess) -> dict[str, float]:
    """kvpool_cluster_nodes{state} as the node's /metrics serves it."""
    with urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics") as answer:
        text = answer.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("kvpool_cluster_nodes{"):
            state = line.split('state="', 1)[1].split('"', 1)[0]
            out[state] = float(line.rsplit(" ", 1)[1])
    return out


def states(config: Path) -> tuple[int, dict[str, str]]:
    out = kvpool(config, "admin", "nodes", "--json")
    return out.returncode, {r["node_id"]: r["state"] for r in json.loads(out.stdout)}


def test_missing_nodes_are_shown_counted_and_forgotten(tmp_path: Path, etcd_endpoint: str,
                                                       cluster_name: str) -> None:
    cluster = {"etcd": [etcd_endpoint], "name": cluster_name, "lease_ttl_s": 2.0}
    a, b = (NodeProcess(tmp_path / n, cluster=cluster, server={"node_id": n, "metrics_port": 0})
            for n in ("node-a", "node-b"))
    config = tmp_path / "admin.yaml"
    config.write_text(f"cluster: {{etcd: ['{etcd_endpoint}'], name: '{cluster_name}'}}\n")
    try:
        a.start()
        b.start()
        assert states(config) == (0, {"node-a": "live", "node-b": "live"})
        wait_for(lambda: cluster_gauge(a) == {"live": 2, "missing": 0, "draining": 0}, 10,
                 "node-a's gauge: 2 live")

        EtcdClient([etcd_endpoint]).put(drained_key(cluster_name, "node-a"), b"{}")
        assert states(config) == (0, {"node-a": "draining", "node-b": "live"})
        wait_for(lambda: cluster_gauge(a) == {"live": 1, "missing": 0, "draining": 1}, 10,
                 "node-a's gauge: 1 draining")
        EtcdClient([etcd_endpoint]).delete(drained_key(cluster_name, "node-a"))

        assert b.terminate() == 0  # a clean stop: no longer registered, still expected
        code, seen = states(config)
        assert (code, seen) == (1, {"node-a": "live", "node-b": "missing"})
        table = kvpool(config, "admin", "nodes")
        assert table.returncode == 1 and "MISSING" in table.stdout
        assert table.stderr.count("\n") == 1 and "node-b" in table.stderr
        wait_for(lambda: cluster_gauge(a) == {"live": 1, "missing": 1, "draining": 0}, 10,
                 "node-a's gauge: 1 missing")
        monitor = kvpool(config, "monitor", "--once", "--json", "--interval", "0.2")
        assert monitor.returncode == 1, monitor.stderr
        doc = json.loads(monitor.stdout)
        assert doc["node-b"]["missing"] is True and doc["node-a"]["up"] is True

        live = kvpool(config, "admin", "forget", "node-a")  # live now: refused
        assert live.returncode == 1 and "live now at " + a.address in live.stderr
        unknown = kvpool(config, "admin", "forget", "node-z")
        assert unknown.returncode == 1 and "not in the expected set" in unknown.stderr
        out = kvpool(config, "admin", "forget", "node-b")
        assert out.returncode == 0, out.stderr
        assert states(config) == (0, {"node-a": "live"})
        wait_for(lambda: cluster_gauge(a) == {"live": 1, "missing": 0, "draining": 0}, 10,
                 "node-a's gauge: nothing missing")
        assert kvpool(config, "monitor", "--once", "--json", "--interval", "0.2").returncode == 0

        b.start()  # registering again puts it back in the expected set
        assert states(config) == (0, {"node-a": "live", "node-b": "live"})
    finally:
        a.stop()
        b.stop()
