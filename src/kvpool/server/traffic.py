"""What the connections of one storage node share (``Traffic``)."""

from __future__ import annotations

import threading

from kvpool.metrics.recorder import LabeledLatency


class Traffic:
    """What the connections of one node share: how many are open (the node's accept loop
    counts them), the requests in flight (counted from every connection's thread), whether
    the node is draining (a connection closes after its current request) and the request
    latency per op (None: metrics.enabled false)."""

    def __init__(self, latency: LabeledLatency | None = None) -> None:
        self.latency = latency
        self.connections = 0  # written by the event loop only
        self.inflight = 0
        self._inflight_lock = threading.Lock()
        self.draining = False

    def begin(self) -> None:
        """A request is in flight (from any thread)."""
        with self._inflight_lock:
            self.inflight += 1

    def end(self) -> None:
        with self._inflight_lock:
            self.inflight -= 1
