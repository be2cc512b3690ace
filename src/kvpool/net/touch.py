"""ReplicaToucher: tells the replicas a read did not fetch from that the read happened.

A read fetches each chunk from one replica; its other replicas would otherwise see the chunk
as never read and evict it first, so a failover would find it gone. The client hands each
read's other-replica keys to a ReplicaToucher, which sends them as TOUCH requests off the
read path. Keys queue per node and coalesce: at most one TOUCH is in flight per node, and it
carries every key queued since the previous one, so a busy reader costs each node a few
TOUCHes per round trip, not one per read.

Failure contract: best effort, never raises to the reader and is never waited for. A node's
queue holds at most ``max_keys`` keys; more are dropped (counted as touch_dropped). A failing
node is handled by ``send`` (the client marks it down; its queued keys are lost).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from kvpool.keys import Namespace

log = logging.getLogger("kvpool.cluster")

#: ``send(node_id, namespace, keys)``: one TOUCH; False if the node failed.
Send = Callable[[str, Namespace, list[bytes]], bool]


class ReplicaToucher:
    """Thread-safe. ``threads`` send TOUCHes (each drains one node's queue at a time), a node's
    queue holds ``max_keys``, a TOUCH carries ``batch_keys`` (cluster.touch_threads,
    touch_max_keys, touch_batch_keys)."""

    def __init__(self, send: Send, threads: int, max_keys: int, batch_keys: int) -> None:
        self._send = send
        self._max_keys = max_keys
        self._batch_keys = batch_keys
        self._queues: dict[str, dict[tuple[bytes, bytes], None]] = {}  # ordered key sets
        self._namespaces: dict[bytes, Namespace] = {}
        self._draining: set[str] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="kvpool-touch")
        self.counters = dict.fromkeys(("touch_requests", "touched_keys", "touch_dropped"), 0)

    def add(self, ns: Namespace, per_node: Mapping[str, Sequence[bytes]]) -> None:
        """Queue ``per_node[node]`` keys for a TOUCH to that node; returns at once."""
        with self._lock:
            if self._closed:
                return
            self._namespaces[ns.id] = ns
            for node_id, keys in per_node.items():
                queue = self._queues.setdefault(node_id, {})
                for key in keys:
                    if len(queue) >= self._max_keys:
                        self.counters["touch_dropped"] += 1
                    else:
                        queue[(ns.id, key)] = None
                if queue and node_id not in self._draining:
                    self._draining.add(node_id)
                    self._threads.submit(self._drain, node_id)

    def pending(self) -> int:
        """Keys queued plus nodes with a TOUCH in flight (0 = every touch has landed)."""
        with self._lock:
            return sum(len(q) for q in self._queues.values()) + len(self._draining)

    def _drain(self, node_id: str) -> None:
        while True:
            with self._lock:
                queue = self._queues.pop(node_id, None)
                if not queue or self._closed:
                    self._draining.discard(node_id)
                    return
            by_ns: dict[bytes, list[bytes]] = {}
            for ns_id, key in queue:
                by_ns.setdefault(ns_id, []).append(key)
            for ns_id, keys in by_ns.items():
                for start in range(0, len(keys), self._batch_keys):
                    batch = keys[start:start + self._batch_keys]
                    try:
                        sent = self._send(node_id, self._namespaces[ns_id], batch)
                    except Exception:  # a touch never surfaces errors
                        log.exception("TOUCH to node %s failed", node_id)
                        sent = False
                    with self._lock:
                        self.counters["touch_requests"] += sent
                        self.counters["touched_keys"] += len(batch) if sent else 0

    def close(self) -> None:
        """Drop what is queued and wait for TOUCHes in flight (each bounded by the request
        timeout). Idempotent."""
        with self._lock:
            self._closed = True
            self._queues.clear()
        self._threads.shutdown(wait=True, cancel_futures=True)
