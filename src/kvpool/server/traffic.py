"""What the connections of one storage node share (``Traffic``)."""

from __future__ import annotations

from kvpool.metrics.recorder import LabeledLatency


class Traffic:
    """What the connections of one node share: how many are open (the node's accept loop
    counts them), the requests in flight (``busy``: the connections serving one, added and
    discarded by each connection's thread; a set's add and discard are atomic, so no lock
    on a request's path), whether the node is draining (a connection closes after its
    current request) and the request latency per op (None: metrics.enabled false)."""

    def __init__(self, latency: LabeledLatency | None = None) -> None:
        self.latency = latency
        self.connections = 0  # written by the event loop only
        self.busy: set[object] = set()
        self.draining = False

    @property
    def inflight(self) -> int:
        """Requests being served now (one per busy connection)."""
        return len(self.busy)
