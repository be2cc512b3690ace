"""deploy/grafana/kvpool.json: a valid dashboard on a ``${DS_PROMETHEUS}`` data source variable,
whose every PromQL expression parses (promtool) and queries only metrics kvpool exports: the
catalogue's names, and what live registries serve (an embedded KVPool that is a client of a
live node, the engine collector the integrations add to it, the node's own /metrics)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from dashboard_queries import (
    DASHBOARD,
    DS,
    expressions,
    panels,
    queried_metrics,
    unknown_metrics,
)
from kvtest import byte_namespace, payload_for, small_config
from metrics_support import metric_names, scrape_url
from node_process import NodeProcess
from prometheus_client.registry import CollectorRegistry

from kvpool import KVPool
from kvpool.metrics import all_metric_names
from kvpool.metrics.engine import EngineCollector, EngineCounts
from kvpool.metrics.recorder import LabeledLatency


def registry_names(registry: CollectorRegistry) -> set[str]:
    """The names a registry exports, as PromQL queries them (counters with ``_total``)."""
    return {f"{f.name}_total" if f.type == "counter" else f.name for f in registry.collect()}


@pytest.fixture(scope="module")
def live_names(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Every name live kvpool registries export: a node's /metrics, and an embedded pool
    that is that node's client (remote tier, node up) with an engine's collector."""
    base = tmp_path_factory.mktemp("dashboard")
    with NodeProcess(base / "node", server={"metrics_port": 0}) as node:
        config = small_config(base / "client", cluster={"nodes": [node.address]})
        with KVPool(config) as pool:
            ns = byte_namespace(salt="dashboard")  # a request, so the node counts one
            pool.register_namespace(ns)
            assert pool.put_many(ns, [b"k" * 16], [payload_for(b"k" * 16)]) == 1
            pool.flush()
            names = metric_names(scrape_url(f"http://127.0.0.1:{node.metrics_port}/metrics"))
            ttft = LabeledLatency()
            ttft.record("hf", 0.05)
            pool.metrics.register(EngineCollector("hf", lambda: EngineCounts(
                lookup_hit_tokens=32, lookup_miss_tokens=0, prefill_tokens_saved=32,
                stored_tokens=64), ttft))
            names |= registry_names(pool.metrics)
    return names


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def test_queried_metrics_extraction() -> None:
    assert queried_metrics(
        'histogram_quantile(0.99, sum by (le, tier, op) '
        '(rate(kvpool_tier_op_seconds_bucket{instance=~"$instance", op="get"}'
        '[$__rate_interval])))') == {"kvpool_tier_op_seconds"}
    assert queried_metrics(
        'sum by (tier) (rate(kvpool_hit_chunks_total[5m])) / ignoring(tier) group_left() '
        '(sum(rate(kvpool_hit_chunks_total[5m])) + sum(rate(kvpool_miss_chunks_total[5m])))'
    ) == {"kvpool_hit_chunks_total", "kvpool_miss_chunks_total"}
    assert queried_metrics("kvpool_used_bytes / kvpool_capacity_bytes > 0.8 offset 1h") == \
        {"kvpool_used_bytes", "kvpool_capacity_bytes"}
    assert queried_metrics('vllm:time_to_first_token_seconds_count{model_name="x"} * 2e-3') \
        == {"vllm:time_to_first_token_seconds"}


def test_dashboard_is_importable_anywhere(dashboard: dict[str, Any]) -> None:
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] and dashboard["title"] and dashboard["id"] is None
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DS, panel["title"]
        assert panel["targets"] and panel["description"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        assert all(t["datasource"] == DS and t["expr"] for t in panel["targets"])
    # Panels do not overlap.
    cells = set()
    for panel in panels(dashboard):
        g = panel["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, panel["title"]
                cells.add((x, y))
    titles = " ".join(p["title"].lower() for p in panels(dashboard))
    for subject in ("hit rate", "time to first token", "read", "written", "latency",
                    "capacity", "errors", "dropped saves", "queue depth", "nodes up",
                    "prefill tokens saved"):
        assert subject in titles, subject


@pytest.mark.prometheus
def test_every_expression_parses(dashboard: dict[str, Any], tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed (Debian package prometheus): " \
        "run scripts/system-deps.sh"
    rules = [{"record": f"kvpool:dashboard_check_{i}",
              "expr": expr.replace("$__rate_interval", "1m").replace("$instance", ".*")}
             for i, expr in enumerate(expressions(dashboard)) if "label_values" not in expr]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    res = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_every_queried_metric_is_exported(dashboard: dict[str, Any],
                                          live_names: set[str]) -> None:
    catalogue = set(all_metric_names())
    assert unknown_metrics(dashboard, catalogue) == {}
    assert unknown_metrics(dashboard, live_names) == {}
    # The registries export nothing else, but a node's prometheus-client process_* metrics.
    assert {n for n in live_names if not n.startswith("process_")} <= catalogue
    assert {n for n in live_names if n.startswith("process_")}  # a node exports them


def test_a_misspelt_metric_is_caught(dashboard: dict[str, Any]) -> None:
    broken = json.loads(json.dumps(dashboard))
    target = next(t for p in panels(broken) for t in p.get("targets", [])
                  if "kvpool_tier_op_seconds_bucket" in t["expr"])
    target["expr"] = target["expr"].replace("kvpool_tier_op_seconds_bucket",
                                            "kvpool_tier_ops_seconds_bucket")
    assert unknown_metrics(broken, set(all_metric_names())) == \
        {target["expr"]: {"kvpool_tier_ops_seconds"}}
