"""What the connections of one storage node share (``Traffic``), and the transport's sizes."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from kvpool.metrics.recorder import LabeledLatency

if TYPE_CHECKING:
    from kvpool.server.connection import Connection

IOV_MAX = 512  # iovecs per sendmsg, under the kernel's UIO_MAXIOV
DISCARD_BYTES = 1 << 20  # scratch for payload bytes read away


class Traffic:
    """What the connections of one node share: the connections being served (the node's
    accept loop fills the table), the requests in flight, whether the node is draining (a
    connection closes after its current request), the network threads and the lanes (threads
    that each serve one connection, lane.py)."""

    def __init__(self, net_threads: int, latency: LabeledLatency | None = None,
                 lanes: int = 0) -> None:
        self.served: dict[asyncio.Task[None], Connection] = {}
        #: Request latency per op (None: metrics.enabled false).
        self.latency = latency
        self.inflight = 0
        self._inflight_lock = threading.Lock()  # lanes count their requests from their threads
        self.draining = False
        self.net_executor = ThreadPoolExecutor(net_threads, thread_name_prefix="kvpool-node-net")
        self.max_lanes = lanes
        self.lanes = 0  # taken and given back on the event loop
        self.lane_executor = ThreadPoolExecutor(max(1, lanes),
                                                thread_name_prefix="kvpool-node-lane")

    @property
    def busy(self) -> bool:
        """More than one request in flight: large transfers then go to network threads."""
        return self.inflight > 1

    def begin(self) -> None:
        """A request is in flight (from any thread)."""
        with self._inflight_lock:
            self.inflight += 1

    def end(self) -> None:
        with self._inflight_lock:
            self.inflight -= 1

    def take_lane(self) -> bool:
        """Reserve a lane for a connection (event loop only); False when all are taken."""
        if self.lanes >= self.max_lanes:
            return False
        self.lanes += 1
        return True

    def shutdown(self) -> None:
        """Wait for the network threads and the lanes to finish (the node is stopping)."""
        self.net_executor.shutdown(wait=True)
        self.lane_executor.shutdown(wait=True)
