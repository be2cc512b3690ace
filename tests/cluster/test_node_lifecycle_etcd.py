"""A node's lifecycle and health with a real etcd (and a real Prometheus): SIGTERM takes the
node out of etcd before in-flight requests end, /readyz follows registration and drains,
and a Prometheus given one node's /sd (http_sd_configs) scrapes every node of the cluster."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from etcd_fixture import EtcdServer
from kvtest import wait_for
from lifecycle_support import bad_lines, http, start_partial_put
from metrics_endpoint import dead_address
from node_process import NodeProcess

from kvpool.cluster.etcd import EtcdClient
from kvpool.cluster.etcd_membership import list_nodes
from kvpool.cluster.membership import drained_prefix

HANG_S = 60.0  # only a hang detector


def cluster_node(base: Path, etcd: str, cluster: str, node_id: str,
                 **server: Any) -> NodeProcess:
    return NodeProcess(base, cluster={"etcd": [etcd], "name": cluster},
                       server={"node_id": node_id, "metrics_port": 0, **server})


def registered(etcd: str, cluster: str) -> set[str]:
    return {n.node_id for n in list_nodes([etcd], cluster)}


def test_sigterm_deregisters_before_in_flight_requests_end(
        tmp_path: Path, etcd_endpoint: str, cluster_name: str) -> None:
    node = cluster_node(tmp_path, etcd_endpoint, cluster_name, "leaving",
                        shutdown_timeout_s=6.0).start()
    try:
        assert node.metrics_port is not None
        assert registered(etcd_endpoint, cluster_name) == {"leaving"}
        assert http(node.metrics_port, "/readyz") == (200, "ready\n")
        stuck = start_partial_put(node.address)  # keeps the stop waiting ~3 s
        assert node.proc is not None
        node.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: not registered(etcd_endpoint, cluster_name), HANG_S,
                 "the deregistration")
        assert node.alive()  # deregistered first, still finishing the request
        code, body = http(node.metrics_port, "/readyz")
        assert code == 503 and "shutting down" in body
        assert node.proc.wait(HANG_S) == 0
        assert not bad_lines(node.log.read_text())
        stuck.close()
    finally:
        node.stop()


def test_registration_lines_have_events_in_json(tmp_path: Path, etcd_server: EtcdServer,
                                                cluster_name: str) -> None:
    """etcd killed (unreachable) and back empty (the lease is lost): JSON lines named
    etcd_unreachable, lease_lost, etcd_reachable, and the node registered again."""
    node = NodeProcess(tmp_path / "node", log={"format": "json"},
                       cluster={"etcd": [etcd_server.endpoint], "name": cluster_name,
                                "lease_ttl_s": 3},
                       server={"node_id": "logged"})

    def events() -> set[str]:
        return {json.loads(line)["event"] for line in node.log.read_text().splitlines()}

    with node:
        etcd_server.kill()
        wait_for(lambda: "etcd_unreachable" in events(), HANG_S, "etcd_unreachable")
        etcd_server.wipe()
        etcd_server.start()
        wait_for(lambda: {"lease_lost", "etcd_reachable"} <= events(), HANG_S,
                 "lease_lost and etcd_reachable")
        wait_for(lambda: registered(etcd_server.endpoint, cluster_name) == {"logged"},
                 HANG_S, "registered again")
    for line in node.log.read_text().splitlines():
        assert json.loads(line)["event"], line


def test_readyz_is_503_until_the_node_is_registered(tmp_path: Path, etcd_server: EtcdServer,
                                                    cluster_name: str) -> None:
    """etcd stopped (SIGSTOP) while the node starts: its metrics port already answers,
    /readyz 503 "starting" until registration fails (exit 2, one line)."""
    port = int(dead_address().rpartition(":")[2])
    node = NodeProcess(tmp_path / "node", cluster={"etcd": [etcd_server.endpoint],
                                                   "name": cluster_name},
                       server={"metrics_port": port})
    assert etcd_server.proc is not None
    answers: list[tuple[int, str]] = []

    def poll() -> None:  # on a thread: start() blocks until the node exits
        deadline = time.monotonic() + HANG_S
        while time.monotonic() < deadline and not answers:
            with contextlib.suppress(OSError):
                answers.append(http(port, "/readyz"))
            time.sleep(0.02)

    etcd_server.proc.send_signal(signal.SIGSTOP)
    poller = threading.Thread(target=poll)
    poller.start()
    try:
        with pytest.raises(RuntimeError, match=r"exited \(2\)"):
            node.start()
    finally:
        poller.join()
        node.stop()
        etcd_server.proc.send_signal(signal.SIGCONT)
    assert answers and answers[0] == (503, "not ready: starting\n")


def test_readyz_is_503_while_the_node_is_drained(
        tmp_path: Path, etcd_endpoint: str, cluster_name: str) -> None:
    with cluster_node(tmp_path, etcd_endpoint, cluster_name, "drainee") as node:
        assert node.metrics_port is not None
        etcd = EtcdClient([etcd_endpoint])
        key = drained_prefix(cluster_name) + "drainee"
        etcd.put(key, b"{}")

        def not_ready() -> bool:
            code, body = http(node.metrics_port or 0, "/readyz")
            return code == 503 and "drained" in body

        wait_for(not_ready, HANG_S, "503 while drained")
        etcd.delete(key)
        wait_for(lambda: http(node.metrics_port or 0, "/readyz")[0] == 200, HANG_S,
                 "ready again")


@contextlib.contextmanager
def prometheus_with_sd(tmp_path: Path, sd_url: str) -> Iterator[str]:
    """A Prometheus whose only scrape config is http_sd_configs at ``sd_url`` (refreshed
    every second); yields its base URL. Stopped by PID afterwards."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed: run scripts/system-deps.sh"
    address = dead_address()
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "kvpool",
                            "http_sd_configs": [{"url": sd_url, "refresh_interval": "1s"}]}]}))
    proc = subprocess.Popen([binary, f"--config.file={config}",
                             f"--storage.tsdb.path={tmp_path / 'prometheus-data'}",
                             f"--web.listen-address={address}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"http://{address}"
    finally:
        proc.terminate()
        proc.wait(30)


def active_targets(base: str) -> list[dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"{base}/api/v1/targets?state=active", timeout=5) as resp:
            doc = json.loads(resp.read())
    except OSError:
        return []
    targets: list[dict[str, Any]] = doc["data"]["activeTargets"]
    return targets


@pytest.mark.prometheus
def test_prometheus_scrapes_every_node_through_one_nodes_sd(
        tmp_path: Path, etcd_endpoint: str, cluster_name: str) -> None:
    nodes = [cluster_node(tmp_path / f"n{i}", etcd_endpoint, cluster_name, f"sd-{i}")
             for i in range(3)]
    try:
        for node in nodes:
            node.start()
        wait_for(lambda: len(registered(etcd_endpoint, cluster_name)) == 3, HANG_S, "3 nodes")
        first = nodes[0].metrics_port
        wait_for(lambda: len(json.loads(http(first or 0, "/sd")[1])) == 3, HANG_S,
                 "3 targets in /sd")
        with prometheus_with_sd(tmp_path, f"http://127.0.0.1:{first}/sd") as base:
            def all_up() -> bool:
                targets = active_targets(base)
                return len(targets) == 3 and all(t["health"] == "up" for t in targets)

            wait_for(all_up, HANG_S, "Prometheus scraping 3 nodes found through /sd")
            targets = active_targets(base)
        seen = {t["labels"]["node"]: t for t in targets}
        assert set(seen) == {"sd-0", "sd-1", "sd-2"}
        for i, node in enumerate(nodes):
            target = seen[f"sd-{i}"]
            assert target["labels"]["instance"] == f"127.0.0.1:{node.metrics_port}"
            assert target["labels"]["cluster"] == cluster_name
        nodes[2].stop()  # a stopped node leaves /sd at once (it deregistered)
        wait_for(lambda: len(json.loads(http(first or 0, "/sd")[1])) == 2, HANG_S,
                 "2 targets after a stop")
    finally:
        for node in nodes:
            node.stop()
