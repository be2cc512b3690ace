"""A storage node's own metrics (catalogue.py, component "server"): request latency per op,
recorded by the connections, and the node's counters, read at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvpool.metrics.families import Families
from kvpool.metrics.recorder import LabeledLatency

#: The installed package's version (its metadata; the source tree's ``__version__`` when
#: run from a checkout that is not installed).
try:
    VERSION = _version("kvpool")
except PackageNotFoundError:  # pragma: no cover - run from sources only
    from kvpool import __version__ as VERSION


class ServerCollector(Collector):
    """``counters``: the node's counter snapshot (NodeStore.counters: ``op_<name>``,
    connections_accepted, auth_failures, protocol_errors, refused_<status>...);
    ``state``: connections open now and whether the node is drained. Also exports
    ``kvpool_build_info{version}``."""

    def __init__(self, counters: Callable[[], dict[str, int]],
                 state: Callable[[], dict[str, Any]], latency: LabeledLatency | None) -> None:
        self._counters = counters
        self._state = state
        self._latency = latency

    def collect(self) -> Iterator[Metric]:
        counts = self._counters()
        state = self._state()
        out = Families()
        out.add("kvpool_server_connections", state["connections"])
        out.add("kvpool_server_draining", 1 if state.get("draining") else 0)
        for name, n in (state.get("cluster_nodes") or {}).items():
            out.add("kvpool_cluster_nodes", n, name)
        out.add("kvpool_build_info", 1, VERSION)
        out.add("kvpool_server_connections_accepted_total", counts.get("connections_accepted", 0))
        out.add("kvpool_server_auth_failures_total", counts.get("auth_failures", 0))
        out.add("kvpool_server_protocol_errors_total", counts.get("protocol_errors", 0))
        out.add("kvpool_server_busy_total", counts.get("refused_busy", 0))
        for name, n in sorted(counts.items()):
            if name.startswith("op_"):
                out.add("kvpool_server_requests_total", n, name[3:])
        if self._latency is not None:
            out.add_histogram("kvpool_server_request_seconds", self._latency.snapshot())
        return iter(out)
