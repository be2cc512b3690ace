"""Reading deploy/grafana/kvpool.json in tests: its panels, its PromQL expressions, and the
metric names each expression queries."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvpool.json"
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w$.:])[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
             "and", "or", "unless", "inf", "nan", "start", "end"}
_SUFFIX = re.compile(r"_(?:bucket|sum|count)$")


def queried_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression selects, ``_bucket`` / ``_sum`` / ``_count``
    stripped: what is left once strings, label matchers, ranges, grouping clauses, function
    calls, keywords and numbers are taken out."""
    text = _STRING.sub(" ", expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    names = {m.group() for m in _IDENT.finditer(text)
             if not text[m.end():].lstrip().startswith("(")} - _KEYWORDS  # not a call
    return {_SUFFIX.sub("", n) for n in names}


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def expressions(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["query"]["query"])
    return exprs


def unknown_metrics(dashboard: dict[str, Any], exported: set[str]) -> dict[str, set[str]]:
    """Per expression, the names it queries that ``exported`` lacks (empty: all fine)."""
    found = {}
    for expr in expressions(dashboard):
        missing = {n for n in queried_metrics(_label_values_metric(expr)) if n not in exported}
        if missing:
            found[expr] = missing
    return found


def _label_values_metric(expr: str) -> str:
    """A template variable's ``label_values(metric, label)`` queries ``metric``."""
    m = re.fullmatch(r"\s*label_values\(\s*([^,]+?)\s*,\s*\w+\s*\)\s*", expr)
    return m.group(1) if m else expr
