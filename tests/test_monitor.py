"""``kvpool monitor``: its maths against real prometheus_client registries served over HTTP on
loopback, and the command (``--once``, ``--json``, the live view, down endpoints) as a
subprocess."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from kvtest import child_env
from metrics_endpoint import MetricsEndpoint, PoolMetrics, dead_address, pool_metrics
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvpool.monitor.maths import counter_increase, histogram_quantile, interval_quantile
from kvpool.monitor.report import endpoint_report
from kvpool.monitor.scrape import Scrape, endpoint_url, scrape

INF = float("inf")


@pytest.fixture
def pool() -> Iterator[tuple[PoolMetrics, MetricsEndpoint]]:
    metrics = pool_metrics()
    with MetricsEndpoint(metrics.registry) as endpoint:
        yield metrics, endpoint


def monitor(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool.cli", "monitor", *args],
                          capture_output=True, text=True, env=child_env(), timeout=timeout)


def test_endpoint_url_forms() -> None:
    assert endpoint_url("127.0.0.1:9100") == "http://127.0.0.1:9100/metrics"
    assert endpoint_url("[::1]:9100") == "http://[::1]:9100/metrics"
    assert endpoint_url("node-a:9100/custom") == "http://node-a:9100/custom"
    assert endpoint_url("http://node-a:9100") == "http://node-a:9100/metrics"
    assert endpoint_url("https://node-a/stats?x=1") == "https://node-a/stats?x=1"
    for bad in ("node-a", "node-a:notaport", "ftp://node-a/metrics", "http://"):
        with pytest.raises(ValueError):
            endpoint_url(bad)


def test_histogram_quantile_follows_prometheus() -> None:
    # 10 observations in (0, 1], 10 in (1, 2]: the rank is interpolated inside its bucket,
    # the first bucket starting at 0.
    buckets = [(1.0, 10.0), (2.0, 20.0), (INF, 20.0)]
    assert histogram_quantile(0.25, buckets) == 0.5
    assert histogram_quantile(0.5, buckets) == 1.0
    assert histogram_quantile(0.75, buckets) == 1.5
    assert histogram_quantile(0.0, buckets) == 0.0
    # A rank in +Inf reports the largest finite bound; order of the pairs does not matter.
    assert histogram_quantile(0.99, [(INF, 10.0), (1.0, 5.0), (2.0, 8.0)]) == 2.0
    # No observation, no +Inf bucket, a single bucket: no figure.
    assert histogram_quantile(0.5, [(1.0, 0.0), (INF, 0.0)]) is None
    assert histogram_quantile(0.5, [(1.0, 3.0), (2.0, 4.0)]) is None
    assert histogram_quantile(0.5, [(INF, 4.0)]) is None
    # A cumulative count that dips (a scrape racing an observation) is raised.
    assert histogram_quantile(0.5, [(1.0, 10.0), (2.0, 8.0), (INF, 20.0)]) == \
        histogram_quantile(0.5, [(1.0, 10.0), (2.0, 10.0), (INF, 20.0)])
    with pytest.raises(ValueError):
        histogram_quantile(1.5, buckets)


def test_interval_figures_from_a_served_registry(
        pool: tuple[PoolMetrics, MetricsEndpoint]) -> None:
    m, endpoint = pool
    url = endpoint_url(endpoint.address)
    # What happened before the first scrape must not count in the interval.
    m.hit_chunks.labels("dram").inc(1000)
    m.miss_chunks.inc(1000)
    for _ in range(5):
        m.tier_op_seconds.labels("dram", "get").observe(9.0)
    m.capacity.labels("dram").set(64 << 20)
    m.used.labels("dram").set(16 << 20)
    m.capacity.labels("ssd").set(1 << 30)  # ssd: capacity, and its used bytes never set
    before = scrape(url, 5)
    assert before.up, before.error

    m.lookups.inc(4)
    m.hit_chunks.labels("dram").inc(30)
    m.hit_chunks.labels("ssd").inc(10)
    m.miss_chunks.inc(10)
    m.read_bytes.labels("dram").inc(30 * 65536)
    m.written_bytes.labels("ssd").inc(5 * 65536)
    for _ in range(50):
        m.tier_op_seconds.labels("dram", "get").observe(3e-4)  # bucket (2.5e-4, 5e-4]
        m.tier_op_seconds.labels("dram", "get").observe(3e-3)  # bucket (2.5e-3, 5e-3]
        m.op_seconds.labels("get").observe(2e-5)  # bucket (1e-5, 2.5e-5]
    m.evictions.labels("dram").inc(7)
    m.checksum_failures.labels("ssd").inc(1)
    m.io_errors.labels("ssd").inc(2)
    m.dropped_saves.labels("ssd_staging", "full").inc(4)
    m.dropped_saves.labels("ssd_staging", "write_error").inc(1)
    m.queue_depth.labels("ssd_write_behind").set(3)
    m.queue_bytes.labels("ssd_write_behind").set(3 * 65536)
    after = scrape(url, 5)
    assert after.up, after.error
    seconds = after.at - before.at

    report = endpoint_report(before, after)
    assert report["up"] and report["kind"] == "pool" and report["interval_s"] == seconds
    overall, tiers = report["overall"], report["tiers"]
    assert list(tiers) == ["dram", "ssd_staging", "ssd"]  # read order, not alphabetical
    assert overall["chunks_asked"] == 50 and overall["hit_rate"] == 40 / 50
    assert overall["hit_rate_since_start"] == 1040 / 2050
    assert overall["lookups_per_s"] == 4 / seconds
    assert overall["get_p50_s"] == pytest.approx(1e-5 + 1.5e-5 * (50 / 100))
    assert overall["put_p99_s"] is None  # nothing put in the interval
    dram, ssd = tiers["dram"], tiers["ssd"]
    assert dram["hit_rate"] == 30 / 50 and ssd["hit_rate"] == 10 / 50
    assert dram["read_gbps"] == 30 * 65536 / seconds / 1e9
    assert dram["write_gbps"] == 0.0 and ssd["write_gbps"] == 5 * 65536 / seconds / 1e9
    # p50: rank 50 = the top of (2.5e-4, 5e-4]; p99: rank 99, 49 of 50 into (2.5e-3, 5e-3].
    assert dram["get_p50_s"] == pytest.approx(5e-4)
    assert dram["get_p99_s"] == pytest.approx(2.5e-3 + 2.5e-3 * 49 / 50)
    assert ssd["get_p50_s"] is None
    assert dram["used_fraction"] == 0.25 and dram["capacity_bytes"] == 64 << 20
    assert ssd["used_bytes"] is None and ssd["used_fraction"] is None  # never set
    assert dram["evictions"] == 7 and ssd["evictions"] == 0
    assert ssd["checksum_failures"] == 1 and ssd["io_errors"] == 2 and ssd["errors"] == 3
    staging = tiers["ssd_staging"]
    assert staging["dropped_saves"] == 5
    assert staging["dropped_by_cause"] == {"full": 4, "write_error": 1}
    assert report["queues"] == {"ssd_write_behind": {"depth": 3, "bytes": 3 * 65536}}
    # This endpoint exposes no node metrics, no remote errors, no chunk gauge: absent, not 0.
    assert "server" not in report and overall["remote_errors"] is None
    assert dram["chunks"] is None


def test_counters_that_went_down_were_reset() -> None:
    name = "kvpool_hit_chunks_total"

    def at(t: float, dram: float, ssd: float) -> Scrape:
        return Scrape("u", t, {name: {(("tier", "dram"),): dram, (("tier", "ssd"),): ssd}})

    # dram restarted from 0 and reached 30; ssd went on from 5 to 8.
    assert counter_increase(at(0, 100, 5), at(1, 30, 8), name) == 33
    assert counter_increase(at(0, 100, 5), at(1, 30, 8), name, tier="ssd") == 3
    down = Scrape("u", 0, error="refused")
    assert counter_increase(down, at(1, 30, 8), name) is None
    bucket = "kvpool_op_seconds_bucket"
    old = Scrape("u", 0, {bucket: {(("le", "1.0"),): 90.0, (("le", "+Inf"),): 100.0}})
    new = Scrape("u", 1, {bucket: {(("le", "1.0"),): 10.0, (("le", "+Inf"),): 10.0}})
    assert interval_quantile(0.5, old, new, "kvpool_op_seconds") == 0.5


def test_node_figures_and_a_garbage_answer() -> None:
    reg = CollectorRegistry()
    conns = Gauge("kvpool_server_connections", "c", registry=reg)
    requests = Counter("kvpool_server_requests_total", "r", ["op"], registry=reg)
    latency = Histogram("kvpool_server_request_seconds", "s", ["op"],
                        buckets=(1e-3, 1e-2, INF), registry=reg)
    with MetricsEndpoint(reg) as endpoint:
        url = endpoint_url(endpoint.address)
        before = scrape(url, 5)
        conns.set(2)
        requests.labels("get").inc(6)
        requests.labels("exists").inc(4)
        for _ in range(10):
            latency.labels("get").observe(5e-3)
        after = scrape(url, 5)
        endpoint.body = b"this is { not metrics\n"
        garbage = scrape(url, 5)
    report = endpoint_report(before, after)
    assert report["kind"] == "node" and report["tiers"] == {}
    server = report["server"]
    assert server["connections"] == 2
    assert server["requests_per_s"] == 10 / (after.at - before.at)
    assert server["request_p50_s"] == pytest.approx(1e-3 + 9e-3 * 0.5)
    assert server["auth_failures"] is None  # not exposed here
    assert not garbage.up and endpoint_report(after, garbage) == \
        {"url": url, "up": False, "error": garbage.error}


def test_once_json_shows_a_dead_endpoint_down(pool: tuple[PoolMetrics, MetricsEndpoint]) -> None:
    m, endpoint = pool
    m.hit_chunks.labels("dram").inc(3)
    dead = dead_address()
    res = monitor("--once", "--json", "--interval", "0.2", "--endpoint", endpoint.address,
                  "--endpoint", dead)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert list(doc) == [endpoint.address, dead]
    assert doc[endpoint.address]["up"] is True
    assert doc[endpoint.address]["url"] == f"http://{endpoint.address}/metrics"
    assert doc[endpoint.address]["overall"]["hit_rate_since_start"] == 1.0
    assert doc[endpoint.address]["tiers"]["dram"]["hit_rate"] is None  # nothing asked since
    assert doc[dead]["up"] is False and "refused" in doc[dead]["error"].lower()

    # The table says so too; every endpoint down is exit 1.
    res = monitor("--once", "--interval", "0.2", "--endpoint", endpoint.address,
                  "--endpoint", dead)
    assert res.returncode == 0 and "DOWN" in res.stdout and "dram" in res.stdout
    res = monitor("--once", "--json", "--interval", "0.2", "--endpoint", dead)
    assert res.returncode == 1 and json.loads(res.stdout)[dead]["up"] is False


def test_bad_arguments_exit_2(tmp_path: object) -> None:
    assert monitor("--once", "--endpoint", "no-port").returncode == 2
    assert monitor("--once", "--interval", "0", "--endpoint", "127.0.0.1:1").returncode == 2
    assert monitor("--json", "--endpoint", "127.0.0.1:1").returncode == 2
    env = {k: v for k, v in child_env().items() if not k.startswith("KVPOOL_")}
    res = subprocess.run([sys.executable, "-m", "kvpool.cli", "monitor", "--once"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 2 and "--endpoint" in res.stderr


def _sigint_as_in_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_live_view_refreshes_and_ctrl_c_exits_0(
        pool: tuple[PoolMetrics, MetricsEndpoint]) -> None:
    m, endpoint = pool
    m.capacity.labels("dram").set(1 << 30)
    master, slave = pty.openpty()  # a real terminal, so rich draws the live view
    # As a shell starts a foreground command: Ctrl-C raises KeyboardInterrupt. (Run from a
    # background job of a shell without job control, the tests inherit SIGINT ignored, and
    # Python then never turns it into KeyboardInterrupt.)
    proc = subprocess.Popen([sys.executable, "-m", "kvpool.cli", "monitor", "--interval",
                             "0.2", "--endpoint", endpoint.address],
                            stdin=slave, stdout=slave, stderr=slave, env=child_env(),
                            preexec_fn=_sigint_as_in_a_terminal)
    os.close(slave)
    seen = b""
    try:
        deadline = time.monotonic() + 60
        # Two draws of the table: the first at start, the next after a refresh.
        while seen.count(b"kvpool monitor") < 2 and time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                seen += os.read(master, 65536)
        assert seen.count(b"kvpool monitor") >= 2, seen.decode(errors="replace")
        assert b"dram" in seen
        proc.send_signal(signal.SIGINT)
        # Read on, as a terminal does: a live view whose terminal stops reading blocks in
        # its next write once the pty's buffer is full (the exit's last redraw is one).
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                with contextlib.suppress(OSError):  # EIO once the child closed the pty
                    os.read(master, 65536)
        assert proc.wait(1) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
