"""kvpool monitor and the Grafana dashboard against a real Prometheus server (Debian package
``prometheus``, started here on loopback): the monitor's quantile equals Prometheus'
``histogram_quantile`` over the same buckets, and every dashboard query runs without error on
what Prometheus scraped from a live node and a live embedded pool."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import yaml
from dashboard_queries import DASHBOARD, expressions
from kvtest import byte_namespace, payload_for, small_config
from metrics_endpoint import BUCKETS, MetricsEndpoint, dead_address
from node_process import NodeProcess
from prometheus_client import CollectorRegistry, Histogram

from kvpool import KVPool
from kvpool.monitor.maths import histogram_quantile
from kvpool.monitor.scrape import endpoint_url, scrape

pytestmark = pytest.mark.prometheus


def prometheus_query(base: str, expr: str) -> list[dict[str, object]]:
    """The result of an instant query; fails the test if Prometheus reports an error."""
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            doc = json.loads(response.read())
    except urllib.error.HTTPError as exc:  # 400 / 422: a bad or failing query
        raise AssertionError(f"{expr}: {exc.read().decode(errors='replace')}") from exc
    assert doc["status"] == "success", doc
    result: list[dict[str, object]] = doc["data"]["result"]
    return result


@contextlib.contextmanager
def prometheus(tmp_path: Path, targets: Sequence[str]) -> Iterator[str]:
    """A Prometheus scraping ``targets`` every second; yields its base URL once it has
    scraped every target at least twice (so rates exist). Stopped by PID afterwards."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed (Debian package prometheus): " \
        "run scripts/system-deps.sh"
    address = dead_address()
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "kvpool",
                            "static_configs": [{"targets": list(targets)}]}]}))
    proc = subprocess.Popen([binary, f"--config.file={config}",
                             f"--storage.tsdb.path={tmp_path / 'prometheus-data'}",
                             f"--web.listen-address={address}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://{address}"
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError):
                scraped = prometheus_query(base, 'count_over_time(up{job="kvpool"}[1m]) >= 2')
                if len(scraped) == len(targets):
                    break
            assert time.monotonic() < deadline, "Prometheus did not scrape in 60 s"
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(30)


def test_quantiles_match_prometheus(tmp_path: Path) -> None:
    reg = CollectorRegistry()
    hist = Histogram("kvpool_tier_op_seconds", "t", ["tier", "op"], buckets=BUCKETS,
                     registry=reg)
    # Spread over several buckets, a first-bucket share (interpolated from 0) and 3 in +Inf.
    for value, times in ((5e-6, 7), (3e-5, 20), (2e-4, 31), (4e-3, 25), (0.3, 11), (20.0, 3)):
        for _ in range(times):
            hist.labels("ssd", "get").observe(value)
    with MetricsEndpoint(reg) as endpoint, prometheus(tmp_path, [endpoint.address]) as base:
        selector = 'kvpool_tier_op_seconds_bucket{tier="ssd",op="get"}'
        ours = scrape(endpoint_url(endpoint.address), 5)
        buckets = [(float(dict(labels)["le"]), value) for labels, value in
                   ours.series("kvpool_tier_op_seconds_bucket").items()]
        for q in (0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0):
            theirs = prometheus_query(base, f"histogram_quantile({q}, {selector})")
            value = float(theirs[0]["value"][1])  # type: ignore[index]
            assert histogram_quantile(q, buckets) == pytest.approx(value, rel=1e-9), q


def test_dashboard_queries_run_on_a_live_node_and_pool(tmp_path: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    with NodeProcess(tmp_path / "node", server={"metrics_port": 0}) as node:
        config = small_config(tmp_path / "client", cluster={"nodes": [node.address]},
                              metrics={"port": 0})
        with KVPool(config) as pool:
            assert pool.metrics_url is not None
            ns = byte_namespace(salt="dashboard")
            pool.register_namespace(ns)
            keys = [bytes([i]) * 16 for i in range(4)]
            assert pool.put_many(ns, keys, [payload_for(k) for k in keys]) == 4
            pool.flush()
            targets = [f"127.0.0.1:{node.metrics_port}",
                       pool.metrics_url.removeprefix("http://").removesuffix("/metrics")]
            with prometheus(tmp_path, targets) as base:
                results = {}
                for expr in expressions(dashboard):
                    if expr.startswith("label_values("):
                        continue  # Grafana's own function, not PromQL
                    query = expr.replace("$__rate_interval", "1m").replace("$instance", ".*")
                    results[expr] = prometheus_query(base, query)
    # Queries over what the workload touched have data: the dashboard selects real series.
    def has_data(fragment: str) -> bool:
        return any(results[e] for e in results if fragment in e)

    for fragment in ("kvpool_hit_chunks_total", "kvpool_written_bytes_total",
                     "kvpool_used_bytes", "kvpool_queue_depth", "kvpool_node_up",
                     "kvpool_server_connections", "kvpool_tier_op_seconds_bucket"):
        assert has_data(fragment), fragment
