"""Builds the metric families of one scrape from the catalogue, so every collector names,
types and labels its samples exactly as catalogue.py says."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvpool.metrics.catalogue import METRICS
from kvpool.metrics.histogram import histogram_family


class Families:
    """Samples of one scrape, grouped by metric. Raises KeyError for a name the catalogue
    lacks or ValueError for wrong label values: a collector bug, caught by the tests."""

    def __init__(self) -> None:
        self._families: dict[str, Metric] = {}
        self._scalars: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}

    def _family(self, name: str) -> CounterMetricFamily | GaugeMetricFamily:
        family = self._scalars.get(name)
        if family is None:
            spec = METRICS[name]
            labels = list(spec.labels)
            if spec.kind == "counter":
                family = CounterMetricFamily(name.removesuffix("_total"), spec.help,
                                             labels=labels)
            elif spec.kind == "gauge":
                family = GaugeMetricFamily(name, spec.help, labels=labels)
            else:
                raise ValueError(f"{name} is a histogram: use add_histogram")
            self._families[name] = self._scalars[name] = family
        return family

    def add(self, name: str, value: float, *label_values: str) -> None:
        spec = METRICS[name]
        if len(label_values) != len(spec.labels):
            raise ValueError(f"{name} takes labels {spec.labels}, got {label_values}")
        self._family(name).add_metric(list(label_values), float(value))

    def add_histogram(self, name: str,
                      series: dict[tuple[str, ...], tuple[list[int], float]]) -> None:
        spec = METRICS[name]
        self._families[name] = histogram_family(name, spec.help, spec.labels, series)

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._families.values())
