"""Reading kvpool's metrics the way Prometheus does: the text exposition, parsed."""

from __future__ import annotations

import urllib.request

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(registry: CollectorRegistry) -> Samples:
    return parse(generate_latest(registry).decode())


def scrape_url(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return parse(resp.read().decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    """A sample's value; KeyError if the exposition lacks it."""
    return samples[(name, frozenset(labels.items()))]


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    return after[key] - before.get(key, 0.0)


def metric_names(samples: Samples) -> set[str]:
    """Family names: histogram samples without _bucket/_count/_sum, counters with _total."""
    out = set()
    for name, _ in samples:
        for suffix in ("_bucket", "_count", "_sum", "_created"):
            if name.endswith(suffix) and not name.endswith("_total"):
                name = name.removesuffix(suffix)
                break
        out.add(name)
    return out
