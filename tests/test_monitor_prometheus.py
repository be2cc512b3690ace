"""The monitor's quantile against a real Prometheus server's ``histogram_quantile`` over the
same buckets: Prometheus (Debian package ``prometheus``) scrapes a registry the test fills,
and both must give the same figure for every quantile."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from metrics_endpoint import BUCKETS, MetricsEndpoint, dead_address
from prometheus_client import CollectorRegistry, Histogram

from kvpool.monitor.maths import histogram_quantile
from kvpool.monitor.scrape import endpoint_url, scrape


def prometheus_query(base: str, expr: str) -> list[dict[str, object]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as response:
        doc = json.loads(response.read())
    assert doc["status"] == "success", doc
    result: list[dict[str, object]] = doc["data"]["result"]
    return result


@pytest.mark.prometheus
def test_quantiles_match_prometheus(tmp_path: Path) -> None:
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed (Debian package prometheus): " \
        "run scripts/system-deps.sh"
    reg = CollectorRegistry()
    hist = Histogram("kvpool_tier_op_seconds", "t", ["tier", "op"], buckets=BUCKETS,
                     registry=reg)
    # Spread over several buckets, a first-bucket share (interpolated from 0) and 3 in +Inf.
    for value, times in ((5e-6, 7), (3e-5, 20), (2e-4, 31), (4e-3, 25), (0.3, 11), (20.0, 3)):
        for _ in range(times):
            hist.labels("ssd", "get").observe(value)
    with MetricsEndpoint(reg) as endpoint:
        address = dead_address()
        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s"},
            "scrape_configs": [{"job_name": "kvpool",
                                "static_configs": [{"targets": [endpoint.address]}]}]}))
        proc = subprocess.Popen([binary, f"--config.file={config}",
                                 f"--storage.tsdb.path={tmp_path / 'data'}",
                                 f"--web.listen-address={address}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            base = f"http://{address}"
            selector = 'kvpool_tier_op_seconds_bucket{tier="ssd",op="get"}'
            deadline = time.monotonic() + 60
            while True:
                try:
                    if prometheus_query(base, selector):
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline, "Prometheus scraped nothing in 60 s"
                time.sleep(0.2)
            ours = scrape(endpoint_url(endpoint.address), 5)
            buckets = [(float(dict(labels)["le"]), value) for labels, value in
                       ours.series("kvpool_tier_op_seconds_bucket").items()]
            for q in (0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0):
                theirs = prometheus_query(base, f"histogram_quantile({q}, {selector})")
                value = float(theirs[0]["value"][1])  # type: ignore[index]
                assert histogram_quantile(q, buckets) == pytest.approx(value, rel=1e-9), q
        finally:
            proc.terminate()
            proc.wait(30)
