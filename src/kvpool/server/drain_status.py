"""A drained node's copying progress in etcd: ``/kvpool/<cluster>/drain_status/<node_id>``.

The node (server/repair.py) writes JSON ``{"state": "copying" | "done" | "blocked",
"copied": n, "failed": n, "chunks": n, "at": unix time}``; ``kvpool admin drain --wait``
(admin/drain.py) reads it. ``done``: every chunk the node holds is on all of its owners under
the placement without the node, so stopping it costs no miss. ``blocked``: there is no
undrained node to copy to.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence

from kvpool.cluster.membership import cluster_prefix

log = logging.getLogger("kvpool.serve")


def drain_status_key(cluster: str, node_id: str) -> str:
    """``/kvpool/<cluster>/drain_status/<node_id>``; ValueError for a malformed cluster."""
    return cluster_prefix(cluster) + "drain_status/" + node_id


class DrainStatus:
    """Writes one node's progress; a failed write is logged (once per outage), never raised."""

    def __init__(self, endpoints: Sequence[str], cluster: str, node_id: str) -> None:
        from kvpool.cluster.etcd import EtcdClient
        self._client = EtcdClient(list(endpoints), 2.0)
        self.key = drain_status_key(cluster, node_id)
        self._warned = False

    def report(self, state: str, **counts: int) -> None:
        value = json.dumps({"state": state, **counts, "at": time.time()}).encode()
        try:
            self._client.put(self.key, value)
            self._warned = False
        except Exception as exc:  # etcd down: the next report tries again
            if not self._warned:
                log.warning("cannot report drain progress to etcd: %s", exc)
                self._warned = True
