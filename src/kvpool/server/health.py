"""A storage node's pages on its metrics port besides ``/metrics``:

- ``/healthz``: 200 ``ok`` while the process answers at all (liveness);
- ``/readyz``: 200 ``ready`` when the node should get traffic, else 503 with the reason on
  one line (starting, not registered in etcd, SSD closed, drained, shutting down);
- ``/sd``: Prometheus HTTP service discovery (``http_sd_configs``): a JSON list with one
  target group per live node of the cluster that serves metrics (from the etcd membership
  the node follows; without etcd, the node itself), labelled ``node`` and ``cluster``;
- ``/events``: the node's KV event endpoints and incarnation (docs/routing.md).

Mechanism only: what "ready" means and which nodes are live are the node's callables.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from kvpool.cluster.membership import NodeInfo
from kvpool.metrics.http import Page, PageHandler

#: None when ready, else why not (one short line).
Readiness = Callable[[], str | None]


def sd_groups(nodes: Iterable[NodeInfo], cluster: str) -> list[dict[str, object]]:
    """One http_sd target group per node that registered a metrics port, sorted by id."""
    groups: list[dict[str, object]] = []
    for node in sorted(nodes, key=lambda n: n.node_id):
        if node.metrics_port is None:
            continue
        host = f"[{node.host}]" if ":" in node.host else node.host
        groups.append({"targets": [f"{host}:{node.metrics_port}"],
                       "labels": {"node": node.node_id, "cluster": cluster}})
    return groups


def health_pages(readiness: Readiness,
                 members: Callable[[], list[NodeInfo]], cluster: str) -> dict[str, PageHandler]:
    """The handlers for MetricsServer's ``pages``."""

    def healthz() -> Page:
        return 200, "text/plain", b"ok\n"

    def readyz() -> Page:
        why = readiness()
        if why is None:
            return 200, "text/plain", b"ready\n"
        return 503, "text/plain", f"not ready: {why}\n".encode()

    def sd() -> Page:
        body = json.dumps(sd_groups(members(), cluster)).encode()
        return 200, "application/json", body

    return {"/healthz": healthz, "/readyz": readyz, "/sd": sd}


def events_page(publisher: Any) -> dict[str, PageHandler]:
    """``/events``: where this node publishes its KV events (docs/routing.md), as JSON;
    ``{"enabled": false}`` when it publishes none."""

    def events() -> Page:
        info = publisher.info() if publisher is not None else {"enabled": False}
        return 200, "application/json", json.dumps(info).encode()

    return {"/events": events}
