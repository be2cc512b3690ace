"""deploy/prometheus/kvpool-alerts.yml: promtool's own unit tests of the rules (series that
fire each alert and series that do not), every metric a rule queries is one kvpool exports
(or one of the agreed cluster gauges), and every PromQL expression in the docs parses."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from dashboard_queries import queried_metrics

from kvpool.metrics.catalogue import all_metric_names

ROOT = Path(__file__).resolve().parents[1]
RULES_DIR = ROOT / "deploy" / "prometheus"
RULES = RULES_DIR / "kvpool-alerts.yml"
RULES_TEST = RULES_DIR / "kvpool-alerts.test.yml"
#: Cluster gauges the membership and repair work exports (issue 22 items 1, 2 and 5).
AGREED_METRICS = {"kvpool_cluster_nodes", "kvpool_repair_pending_chunks"}
ALERTS = {"KvpoolNodeMissing", "KvpoolReplicasBelowTarget", "KvpoolChecksumFailures",
          "KvpoolDroppedSaves", "KvpoolSsdNearlyFull"}


def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool is not installed (Debian package prometheus): " \
        "run scripts/system-deps.sh"
    return found


def rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


@pytest.mark.prometheus
def test_the_alert_rules_pass_their_promtool_tests() -> None:
    for args in (["check", "rules", RULES.name], ["test", "rules", RULES_TEST.name]):
        res = subprocess.run([promtool(), *args], cwd=RULES_DIR, capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr


def test_every_alert_is_tested_firing_and_quiet() -> None:
    assert {r["alert"] for r in rules()} == ALERTS
    cases: dict[str, set[bool]] = {}
    for test in yaml.safe_load(RULES_TEST.read_text())["tests"]:
        for case in test["alert_rule_test"]:
            cases.setdefault(case["alertname"], set()).add(bool(case["exp_alerts"]))
    assert cases == {name: {True, False} for name in ALERTS}


def test_every_metric_the_rules_query_is_exported() -> None:
    exported = set(all_metric_names()) | AGREED_METRICS
    for rule in rules():
        used = queried_metrics(rule["expr"])
        assert used, rule["alert"]
        assert used <= exported, (rule["alert"], used - exported)


def test_a_misspelt_metric_in_a_rule_is_caught() -> None:
    assert queried_metrics('increase(kvpool_checksum_failure_total{tier="ssd"}[10m]) > 0') \
        == {"kvpool_checksum_failure_total"}


# ---------------------------------------------------------------- the docs' PromQL
_BLOCK = re.compile(r"```promql\n(.*?)```", re.S)


def doc_expressions() -> dict[str, str]:
    """Every expression of a ```promql block in docs/*.md, by "file: first line": an
    expression starts at an unindented line and runs over the indented lines after it;
    ``#`` lines are comments."""
    found: dict[str, str] = {}
    for doc in sorted((ROOT / "docs").glob("*.md")):
        for block in _BLOCK.findall(doc.read_text()):
            current: list[str] = []
            for line in [*block.splitlines(), ""]:
                if line.startswith((" ", "\t")) and current:
                    current.append(line)
                    continue
                if current:
                    found[f"{doc.name}: {current[0]}"] = "\n".join(current)
                current = [line] if line.strip() and not line.startswith("#") else []
    return found


def test_the_docs_have_promql_to_check() -> None:
    exprs = doc_expressions()
    assert any("kvpool_hit_chunks_total" in e for e in exprs.values()), exprs


@pytest.mark.prometheus
def test_every_promql_expression_in_the_docs_parses(tmp_path: Path) -> None:
    exprs = doc_expressions()
    exported = set(all_metric_names()) | AGREED_METRICS
    for where, expr in exprs.items():
        assert queried_metrics(expr) <= exported, where
    path = tmp_path / "docs.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "docs", "rules": [
        {"record": f"kvpool:docs_check_{i}", "expr": expr}
        for i, expr in enumerate(exprs.values())]}]}))
    res = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
