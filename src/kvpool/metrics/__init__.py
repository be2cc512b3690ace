"""Prometheus metrics of kvpool: the catalogue of names (catalogue.py), cheap latency
histograms (histogram.py, recorder.py), collectors that read the tiers' own counters at
scrape time (pool_collector.py, server_collector.py), engine counters (engine.py) and the
HTTP endpoint (http.py). docs/operations.md lists every metric."""

from kvpool.metrics.catalogue import METRICS, all_metric_names

__all__ = ["METRICS", "all_metric_names"]
