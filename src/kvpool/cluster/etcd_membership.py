"""The live storage nodes of a cluster as etcd lists them, kept current by a watch.

:class:`EtcdMembership` reads ``/kvpool/<cluster>/`` (the registered nodes under ``nodes/``,
the drained ones under ``drained/``; the layout is in :mod:`kvpool.cluster.membership`) and
watches it from that read's revision; :func:`list_nodes` is the one-shot read behind
``kvpool admin nodes``.

Failure policy: the store must never fail a request because etcd is down. A running
:class:`EtcdMembership` keeps serving the last set it saw while etcd is unreachable, logs one
warning per outage, and re-reads the prefix when etcd is back. Only the constructor and
:func:`list_nodes` raise :class:`~kvpool.cluster.etcd.EtcdError`, so that a misconfigured
endpoint is loud at start.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Sequence

from kvpool.cluster.etcd import (
    EtcdClient,
    EtcdError,
    KeyValue,
    WatchResponse,
    WatchStream,
)
from kvpool.cluster.membership import (
    NodeInfo,
    cluster_prefix,
    drained_prefix,
    nodes_prefix,
    sorted_nodes,
)

__all__ = ["EtcdMembership", "OnChange", "list_nodes"]

log = logging.getLogger(__name__)

# Reconnect backoff of the watch thread (seconds), with ±20% jitter.
_BACKOFF_MIN_S = 0.1
_BACKOFF_MAX_S = 2.0
# A watch stream that has been silent this long is checked with a read on its endpoint, so a
# member that hangs (rather than closing the connection) is noticed.
_WATCH_IDLE_CHECK_S = 5.0

OnChange = Callable[[list[NodeInfo]], None]


def _node_from_kv(prefix: bytes, kv: KeyValue) -> NodeInfo | None:
    """The node a key holds, or None (logged) if the value is not a valid record for it."""
    key_id = kv.key[len(prefix):].decode("utf-8", "replace")
    try:
        node = NodeInfo.from_json(kv.value)
    except ValueError as exc:
        log.warning("kvpool membership: ignoring %s: %s", kv.key.decode("utf-8", "replace"), exc)
        return None
    if node.node_id != key_id:
        log.warning("kvpool membership: ignoring %s: its record names node %r",
                    kv.key.decode("utf-8", "replace"), node.node_id)
        return None
    return node


class _Backoff:
    def __init__(self) -> None:
        self._next = _BACKOFF_MIN_S

    def reset(self) -> None:
        self._next = _BACKOFF_MIN_S

    def next(self) -> float:
        delay = self._next * random.uniform(0.8, 1.2)
        self._next = min(self._next * 2, _BACKOFF_MAX_S)
        return delay


class EtcdMembership:
    """Live (and drained) nodes of ``cluster`` from etcd, kept current by a watch in a daemon
    thread.

    The constructor reads ``/kvpool/<cluster>/`` once and raises
    :class:`~kvpool.cluster.etcd.EtcdError` if no endpoint answers (ValueError for malformed
    endpoints or cluster name). From then on nothing raises: :meth:`live_nodes` returns the
    last set seen without touching the network; when etcd becomes unreachable the thread logs
    one warning, keeps that set, and retries with backoff (0.1 s doubling to 2 s); once etcd
    answers it re-reads the prefix and watches from the revision of that read, so changes
    made meanwhile (including a restart with lost data) are picked up.

    ``on_change`` is called from the watch thread with the new sorted list each time the set
    changes (not for the initial read); an exception it raises is logged and ignored. Every
    node that joins or leaves the set (the initial read included) is one INFO line, event
    ``node_joined`` / ``node_left``.
    """

    def __init__(self, endpoints: Sequence[str], cluster: str,
                 on_change: OnChange | None = None, timeout_s: float = 2.0) -> None:
        self.cluster = cluster
        self._root = cluster_prefix(cluster).encode("utf-8")
        self._prefix = nodes_prefix(cluster).encode("utf-8")
        self._drained_prefix = drained_prefix(cluster).encode("utf-8")
        self._client = EtcdClient(endpoints, timeout_s)
        self._on_change = on_change
        self._lock = threading.Lock()
        self._nodes: dict[bytes, NodeInfo] = {}
        self._view: list[NodeInfo] = []
        self._drained: frozenset[str] = frozenset()
        self._drained_logged: frozenset[str] = frozenset()  # the drains the log has named
        self._stop = threading.Event()
        self._stream: WatchStream | None = None
        self._revision = self._resync(notify=False)
        self._thread = threading.Thread(target=self._run, name=f"kvpool-membership-{cluster}",
                                        daemon=True)
        self._thread.start()

    def live_nodes(self) -> list[NodeInfo]:
        """The live nodes sorted by node_id, as last seen; never blocks on etcd, never raises."""
        with self._lock:
            return list(self._view)

    def drained_nodes(self) -> frozenset[str]:
        """Ids under ``/kvpool/<cluster>/drained/`` as last seen; never blocks, never raises."""
        with self._lock:
            return self._drained

    def close(self) -> None:
        """Stop the watch thread and close its stream; idempotent."""
        self._stop.set()
        with self._lock:
            stream = self._stream
        if stream is not None:
            stream.close()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self._client.timeout_s * (len(self._client.endpoints) + 1) + 1)

    def __enter__(self) -> EtcdMembership:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- watch thread ---------------------------------------------------------------------

    def _resync(self, notify: bool) -> int:
        """Replace the node set with a fresh range read; the read's revision."""
        kvs, revision = self._client.get_prefix(self._root)
        nodes = {kv.key: node for kv in kvs if kv.key.startswith(self._prefix)
                 and (node := _node_from_kv(self._prefix, kv))}
        drained = frozenset(self._drained_id(kv.key) for kv in kvs
                            if kv.key.startswith(self._drained_prefix))
        with self._lock:
            self._nodes = nodes
            self._drained = drained
        self._publish(notify)
        return revision

    def _publish(self, notify: bool) -> None:
        with self._lock:
            view = sorted_nodes(self._nodes.values())
            drained_before, self._drained_logged = self._drained_logged, self._drained
            drained = self._drained
            before = self._view
            self._view = view
        _log_drains(self.cluster, drained_before, drained)
        if view == before:
            return
        _log_changes(self.cluster, before, view)
        if notify and self._on_change is not None:
            try:
                self._on_change(list(view))
            except Exception:
                log.exception("kvpool membership: on_change callback failed")

    def _apply(self, msg: WatchResponse) -> None:
        with self._lock:
            for event in msg.events:
                if event.kv.key.startswith(self._drained_prefix):
                    node_id = self._drained_id(event.kv.key)
                    self._drained = (self._drained - {node_id} if event.type == "DELETE"
                                     else self._drained | {node_id})
                    continue
                if not event.kv.key.startswith(self._prefix):
                    continue  # another kind of cluster key: not membership's
                if event.type == "DELETE":
                    self._nodes.pop(event.kv.key, None)
                elif node := _node_from_kv(self._prefix, event.kv):
                    self._nodes[event.kv.key] = node
                else:
                    self._nodes.pop(event.kv.key, None)
        self._publish(notify=True)

    def _drained_id(self, key: bytes) -> str:
        return key[len(self._drained_prefix):].decode("utf-8", "replace")

    def _run(self) -> None:
        backoff = _Backoff()
        warned = False
        need_range = False  # the constructor just read
        while not self._stop.is_set():
            try:
                if need_range:
                    self._revision = self._resync(notify=True)
                need_range = True  # whatever ends this watch, re-read before the next one
                stream = self._client.watch_prefix(self._root, self._revision + 1)
                with self._lock:
                    self._stream = stream
                if self._stop.is_set():
                    stream.close()
                    break
                try:
                    first = stream.next(self._client.timeout_s)
                    if first is None or not first.created:
                        raise EtcdError(f"etcd {stream.endpoint} watch: not created "
                                        f"({first!r})", endpoint=stream.endpoint)
                    backoff.reset()
                    if warned:
                        log.info("kvpool membership %s: etcd reachable again at %s; "
                                    "%d live nodes", self.cluster, stream.endpoint,
                                    len(self.live_nodes()),
                                    extra={"event": "etcd_reachable", "cluster": self.cluster})
                        warned = False
                    self._follow(stream)
                finally:
                    stream.close()
                    with self._lock:
                        self._stream = None
            except EtcdError as exc:
                if self._stop.is_set():
                    break
                if not warned:
                    log.warning("kvpool membership %s: etcd unreachable, keeping the last "
                                "known %d nodes and retrying: %s", self.cluster,
                                len(self.live_nodes()), exc,
                                extra={"event": "etcd_unreachable", "cluster": self.cluster})
                    warned = True
                else:
                    log.debug("kvpool membership %s: still unreachable: %s", self.cluster, exc)
                self._stop.wait(backoff.next())
            except Exception:  # a bug must not kill the thread and freeze membership silently
                log.exception("kvpool membership %s: watch thread error", self.cluster)
                self._stop.wait(backoff.next())

    def _follow(self, stream: WatchStream) -> None:
        """Apply the stream's events until it is canceled (returns) or fails (raises)."""
        checker = EtcdClient([stream.endpoint], self._client.timeout_s)
        while not self._stop.is_set():
            msg = stream.next(_WATCH_IDLE_CHECK_S)
            if msg is None:
                checker.health()  # silent stream: is its member still answering?
                continue
            if msg.canceled:  # compacted past our revision, or canceled by etcd: re-read
                log.info("kvpool membership %s: watch canceled (compacted to %d%s), re-reading",
                         self.cluster, msg.compact_revision,
                         f", {msg.cancel_reason}" if msg.cancel_reason else "")
                return
            if msg.events:
                self._apply(msg)


def _log_changes(cluster: str, before: list[NodeInfo], after: list[NodeInfo]) -> None:
    """One INFO line per node that joined or left (events node_joined / node_left); a node
    whose address changed under the same id leaves and joins."""
    gone, new = set(before) - set(after), set(after) - set(before)
    for node in sorted_nodes(gone):
        log.info("kvpool membership %s: node %s (%s) left", cluster, node.node_id,
                 node.address(), extra={"event": "node_left", "cluster": cluster,
                                        "node": node.node_id, "address": node.address()})
    for node in sorted_nodes(new):
        log.info("kvpool membership %s: node %s (%s) joined", cluster, node.node_id,
                 node.address(), extra={"event": "node_joined", "cluster": cluster,
                                        "node": node.node_id, "address": node.address()})


def _log_drains(cluster: str, before: frozenset[str], after: frozenset[str]) -> None:
    """One INFO line per node drained or undrained (events node_drained / node_undrained)."""
    for node_id, event, what in [*((n, "node_undrained", "undrained") for n in
                                   sorted(before - after)),
                                 *((n, "node_drained", "drained: no new chunks") for n in
                                   sorted(after - before))]:
        log.info("kvpool membership %s: node %s %s", cluster, node_id, what,
                 extra={"event": event, "cluster": cluster, "node": node_id})


def list_nodes(endpoints: Sequence[str], cluster: str, timeout_s: float = 2.0) -> list[NodeInfo]:
    """The nodes registered in ``cluster`` right now, sorted by node_id (one range read).

    Raises EtcdError if etcd cannot be reached, ValueError for malformed endpoints or cluster
    name. Keys whose value is not a valid node record are skipped with a warning.
    """
    prefix = nodes_prefix(cluster).encode("utf-8")
    kvs, _ = EtcdClient(endpoints, timeout_s).get_prefix(prefix)
    return sorted_nodes(node for kv in kvs if (node := _node_from_kv(prefix, kv)))
