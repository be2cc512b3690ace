"""The live storage nodes of a cluster as etcd lists them, kept current by a watch.

:class:`EtcdMembership` reads ``/kvpool/<cluster>/`` (the registered nodes under ``nodes/``,
the drained ones under ``drained/``; the layout is in :mod:`kvpool.cluster.membership`) and
watches it from that read's revision; :func:`list_nodes` and :func:`read_cluster` are the
one-shot reads behind ``kvpool admin nodes``. It also follows the expected set (``expected/``).

A node whose key disappears without the node having marked it ``stopping`` (its lease expired:
it died, or etcd was paused or partitioned from it longer than the TTL) stays in the view for
``grace_s`` (``cluster.membership_grace_s``) unless it registers again meanwhile: a client
keeps placing on a node that still answers (requests that fail mark it down at once, see
net/client.py), so etcd losing every lease at once does not empty the view. A node that
stopped cleanly (record marked ``stopping``) leaves at once.

Failure policy: the store must never fail a request because etcd is down. A running
:class:`EtcdMembership` keeps serving the last set it saw while etcd is unreachable, logs one
warning per outage, and re-reads the prefix when etcd is back. Only the constructor and
:func:`list_nodes` raise :class:`~kvpool.cluster.etcd.EtcdError`, so that a misconfigured
endpoint is loud at start.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
    expected_prefix,
    nodes_prefix,
    sorted_nodes,
)

__all__ = ["ClusterRead", "EtcdMembership", "OnChange", "list_nodes", "read_cluster"]

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
                 on_change: OnChange | None = None, timeout_s: float = 2.0,
                 grace_s: float = 0.0) -> None:
        if grace_s < 0:
            raise ValueError("grace_s must be >= 0")
        self.cluster = cluster
        self.grace_s = float(grace_s)
        self._root = cluster_prefix(cluster).encode("utf-8")
        self._prefix = nodes_prefix(cluster).encode("utf-8")
        self._drained_prefix = drained_prefix(cluster).encode("utf-8")
        self._expected_prefix = expected_prefix(cluster).encode("utf-8")
        self._client = EtcdClient(endpoints, timeout_s)
        self._on_change = on_change
        self._lock = threading.Lock()
        self._nodes: dict[bytes, NodeInfo] = {}
        # nodes whose key vanished without a clean leave: (record, monotonic expiry)
        self._ghosts: dict[bytes, tuple[NodeInfo, float]] = {}
        self._next_expiry = float("inf")
        self._view: list[NodeInfo] = []
        self._drained: frozenset[str] = frozenset()
        self._expected: frozenset[str] = frozenset()
        self._drained_logged: frozenset[str] = frozenset()  # the drains the log has named
        self._stop = threading.Event()
        self._stream: WatchStream | None = None
        self._revision = self._resync(notify=False)
        self._thread = threading.Thread(target=self._run, name=f"kvpool-membership-{cluster}",
                                        daemon=True)
        self._thread.start()

    def live_nodes(self) -> list[NodeInfo]:
        """The live nodes sorted by node_id, as last seen (with the nodes still in their
        grace period); never blocks on etcd, never raises."""
        if time.monotonic() >= self._next_expiry:
            self._publish(notify=True)
        with self._lock:
            return list(self._view)

    def expected_nodes(self) -> frozenset[str]:
        """Ids under ``/kvpool/<cluster>/expected/`` as last seen: every node that registered
        and was not forgotten (``kvpool admin forget``); never blocks, never raises."""
        with self._lock:
            return self._expected

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
        records = {kv.key: node for kv in kvs if kv.key.startswith(self._prefix)
                   and (node := _node_from_kv(self._prefix, kv))}
        nodes = {key: node for key, node in records.items() if not node.stopping}
        drained = frozenset(self._drained_id(kv.key) for kv in kvs
                            if kv.key.startswith(self._drained_prefix))
        expected = frozenset(kv.key[len(self._expected_prefix):].decode("utf-8", "replace")
                             for kv in kvs if kv.key.startswith(self._expected_prefix))
        with self._lock:
            for key, node in self._nodes.items():
                if key not in records:  # gone; one marked stopping left cleanly
                    self._vanished(key, node)
            for key in nodes:
                self._ghosts.pop(key, None)
            self._nodes = nodes
            self._drained = drained
            self._expected = expected
        self._publish(notify)
        return revision

    def _vanished(self, key: bytes, node: NodeInfo) -> None:
        """``node``'s key is gone without a clean leave: keep it for the grace period.
        Called with the lock held."""
        if self.grace_s > 0:
            self._ghosts[key] = (node, time.monotonic() + self.grace_s)

    def _publish(self, notify: bool) -> None:
        with self._lock:
            now = time.monotonic()
            self._ghosts = {k: g for k, g in self._ghosts.items()
                            if g[1] > now and k not in self._nodes}
            self._next_expiry = min((g[1] for g in self._ghosts.values()), default=float("inf"))
            view = sorted_nodes([*self._nodes.values(), *(g[0] for g in self._ghosts.values())])
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
                key = event.kv.key
                if key.startswith(self._drained_prefix):
                    node_id = self._drained_id(key)
                    self._drained = (self._drained - {node_id} if event.type == "DELETE"
                                     else self._drained | {node_id})
                    continue
                if key.startswith(self._expected_prefix):
                    node_id = key[len(self._expected_prefix):].decode("utf-8", "replace")
                    self._expected = (self._expected - {node_id} if event.type == "DELETE"
                                      else self._expected | {node_id})
                    continue
                if not key.startswith(self._prefix):
                    continue  # another kind of cluster key: not membership's
                if event.type == "DELETE":
                    gone = self._nodes.pop(key, None)
                    if gone is not None:
                        self._vanished(key, gone)
                elif node := _node_from_kv(self._prefix, event.kv):
                    self._ghosts.pop(key, None)
                    if node.stopping:  # a clean leave: out at once, no grace
                        self._nodes.pop(key, None)
                    else:
                        self._nodes[key] = node
                else:
                    self._nodes.pop(key, None)
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
            elif time.monotonic() >= self._next_expiry:
                self._publish(notify=True)


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


@dataclass(frozen=True)
class ClusterRead:
    """One consistent read of a cluster: registered nodes (sorted by id), the expected set
    (node id -> the address it last registered with, "" if its entry does not say) and the
    drained set."""

    nodes: list[NodeInfo]
    expected: dict[str, str]
    drained: frozenset[str]


def read_cluster(endpoints: Sequence[str], cluster: str, timeout_s: float = 2.0) -> ClusterRead:
    """Nodes, expected set and drains of ``cluster`` in one range read. Raises as
    :func:`list_nodes`."""
    root = cluster_prefix(cluster).encode("utf-8")
    prefixes = {name: p(cluster).encode("utf-8") for name, p in
                (("nodes", nodes_prefix), ("expected", expected_prefix),
                 ("drained", drained_prefix))}
    kvs, _ = EtcdClient(endpoints, timeout_s).get_prefix(root)

    def ids(name: str) -> frozenset[str]:
        p = prefixes[name]
        return frozenset(kv.key[len(p):].decode("utf-8", "replace") for kv in kvs
                         if kv.key.startswith(p))

    nodes = sorted_nodes(node for kv in kvs if kv.key.startswith(prefixes["nodes"])
                         and (node := _node_from_kv(prefixes["nodes"], kv)))
    p = prefixes["expected"]
    expected = {kv.key[len(p):].decode("utf-8", "replace"): _expected_address(kv.value)
                for kv in kvs if kv.key.startswith(p)}
    return ClusterRead(nodes=nodes, expected=expected, drained=ids("drained"))


def _expected_address(value: bytes) -> str:
    """The address an expected-set entry names ("" if it is not the JSON a node writes)."""
    try:
        doc = json.loads(value)
    except ValueError:
        return ""
    return str(doc.get("address") or "") if isinstance(doc, dict) else ""
