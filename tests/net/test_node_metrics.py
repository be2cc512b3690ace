"""A real node's /metrics: the server's own figures and its pool's move by exactly what a
client did (puts, hits, misses, a bad AUTH, a malformed frame), a client pool sees the node up,
every name in the catalogue is exported by some component, and a real Prometheus server
scrapes the node and answers queries over what it scraped."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from kvtest import byte_namespace, payload_for, small_config
from metrics_support import delta, metric_names, scrape, scrape_url, value
from node_process import NodeProcess

from kvpool.metrics import all_metric_names
from kvpool.metrics.engine import EngineCollector, EngineCounts
from kvpool.metrics.recorder import LabeledLatency
from kvpool.net.connection import NodeConnection
from kvpool.net.protocol import HEADER_BYTES, AuthError
from kvpool.pool import KVPool
from kvpool.tiers.directory import MIN_ENTRIES, ReadDirectory

CHUNK = 64 * 1024
TOKEN, ADMIN = "token-acme-123", "admin-token-0"


@pytest.fixture
def metrics_node(tmp_path: Path) -> Iterator[NodeProcess]:
    with NodeProcess(tmp_path / "n", server={
            "metrics_port": 0, "auth": [{"token": TOKEN, "tenants": ["acme"]}],
            "admin_token": ADMIN}, pool={"tenant_quotas": {"acme": {"dram_bytes": "8MiB"}}}) \
            as node:
        yield node


def node_url(node: NodeProcess) -> str:
    assert node.metrics_port is not None
    return f"http://127.0.0.1:{node.metrics_port}/metrics"


def test_node_metrics_move_by_exactly_what_a_client_did(metrics_node: NodeProcess) -> None:
    url = node_url(metrics_node)
    before = scrape_url(url)
    ns = byte_namespace(CHUNK, salt="acme:a")
    keys = [os.urandom(16) for _ in range(4)]
    conn = NodeConnection(metrics_node.address, token=TOKEN)
    try:
        assert conn.put(ns, keys, [payload_for(k, CHUNK) for k in keys]) == 4
        outs = [np.zeros(CHUNK, np.uint8) for _ in range(6)]
        missing = [os.urandom(16) for _ in range(2)]
        assert conn.get_into(ns, [*keys, *missing], outs) == [True] * 4 + [False] * 2
        after = scrape_url(url)
        assert value(after, "kvpool_server_connections") == 1
    finally:
        conn.close()
    with pytest.raises(AuthError):
        NodeConnection(metrics_node.address, token="not-the-token").close()
    with socket.create_connection(("127.0.0.1", metrics_node.port)) as raw:
        raw.sendall(b"GARBAGE!" * (HEADER_BYTES // 8))  # not a frame: the node hangs up
        raw.settimeout(10)
        assert raw.recv(1) == b""
    after = scrape_url(url)
    assert delta(before, after, "kvpool_server_requests_total", op="put") == 1
    assert delta(before, after, "kvpool_server_requests_total", op="get") == 1
    assert delta(before, after, "kvpool_server_request_seconds_count", op="get") == 1
    assert delta(before, after, "kvpool_server_auth_failures_total") == 1
    assert delta(before, after, "kvpool_server_protocol_errors_total") == 1
    assert delta(before, after, "kvpool_server_connections_accepted_total") == 3
    assert value(after, "kvpool_server_draining") == 0
    # the node's own pool: what the PUT and the GET did to its tiers
    assert delta(before, after, "kvpool_written_bytes_total", tier="dram") == 4 * CHUNK
    assert delta(before, after, "kvpool_hit_chunks_total", tier="dram") == 4
    assert delta(before, after, "kvpool_read_bytes_total", tier="dram") == 4 * CHUNK
    assert delta(before, after, "kvpool_miss_chunks_total") == 2
    assert value(after, "kvpool_chunks", tier="dram") == 4


def test_every_catalogue_metric_is_exported_and_nothing_else(metrics_node: NodeProcess,
                                                             tmp_path: Path) -> None:
    """A client pool with DRAM (keeping a read directory, as a host pool's tenant pool
    does), SSD and the node, the node itself and an engine collector export every name of
    the catalogue, and no kvpool_ name the catalogue lacks."""
    cfg = small_config(tmp_path / "client", cluster={"nodes": [metrics_node.address],
                                                     "token": TOKEN})
    ns = byte_namespace(CHUNK, salt="acme:b")
    with KVPool(cfg) as pool:
        assert pool.share_directory(ReadDirectory(MIN_ENTRIES))
        pool.register_namespace(ns)
        key = ns.chunk_keys([3])[0]
        pool.put(ns, key, payload_for(key, CHUNK))
        assert pool.lookup(ns, [key]) == 1
        outs = [np.zeros(CHUNK, np.uint8)]
        assert pool.get_many_into(ns, [key], outs) == [True]
        assert pool.flush(30)
        ttft = LabeledLatency()
        ttft.record("hf", 0.1)
        pool.metrics.register(EngineCollector("hf", lambda: EngineCounts(
            lookup_hit_tokens=1, lookup_miss_tokens=0, prefill_tokens_saved=1,
            stored_tokens=1), ttft))
        client = scrape(pool.metrics)
    assert value(client, "kvpool_node_up", node=metrics_node.address) == 1
    assert value(client, "kvpool_written_bytes_total", tier="remote") == CHUNK
    assert value(client, "kvpool_written_bytes_total", tier="cluster_staging") == CHUNK
    node = scrape_url(node_url(metrics_node))
    exported = {n for n in metric_names(client) | metric_names(node) if n.startswith("kvpool_")}
    assert exported == set(all_metric_names())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _query(port: int, expr: str) -> list[dict[str, object]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as resp:
        doc = json.load(resp)
    assert doc["status"] == "success", doc
    return list(doc["data"]["result"])


@pytest.mark.prometheus
def test_a_real_prometheus_scrapes_the_node(metrics_node: NodeProcess, tmp_path: Path) -> None:
    binary = shutil.which("prometheus")
    assert binary is not None, "prometheus is missing: run scripts/system-deps.sh"
    ns = byte_namespace(CHUNK, salt="acme:p")
    keys = [os.urandom(16) for _ in range(5)]
    conn = NodeConnection(metrics_node.address, token=TOKEN)
    try:
        assert conn.put(ns, keys, [payload_for(k, CHUNK) for k in keys]) == 5
        for _ in range(3):  # 15 hits, 3 GET requests
            outs = [np.zeros(CHUNK, np.uint8) for _ in keys]
            assert conn.get_into(ns, keys, outs) == [True] * 5
    finally:
        conn.close()
    port = _free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
scrape_configs:
  - job_name: kvpool
    static_configs: [{{targets: ["127.0.0.1:{metrics_node.metrics_port}"]}}]
""")
    with open(tmp_path / "prometheus.log", "w") as log:  # the child keeps its own copy
        proc = subprocess.Popen([binary, f"--config.file={config}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        hits: list[dict[str, object]] = []
        while time.monotonic() < deadline:
            try:
                hits = _query(port, 'kvpool_hit_chunks_total{tier="dram"}')
            except OSError:
                hits = []  # not listening yet
            if hits:
                break
            time.sleep(0.5)
        assert hits, (tmp_path / "prometheus.log").read_text()[-2000:]
        assert float(hits[0]["value"][1]) == 15  # type: ignore[index]
        p99 = _query(port, 'histogram_quantile(0.99, sum by (le) '
                           '(kvpool_server_request_seconds_bucket{op="get"}))')
        seconds = float(p99[0]["value"][1])  # type: ignore[index]
        assert 0 < seconds <= 10
        up = _query(port, 'up{job="kvpool"}')
        assert float(up[0]["value"][1]) == 1  # type: ignore[index]
    finally:
        proc.terminate()
        proc.wait(30)
