"""Which storage nodes are live: a static list, or etcd leases watched under a key prefix.

Layout in etcd (DESIGN.md §6): each node puts ``/kvpool/<cluster>/nodes/<node_id>`` with a JSON
:class:`NodeInfo` value, attached to a lease it keeps alive (:class:`NodeRegistration`). When
the node stops cleanly it revokes the lease and its key disappears at once; when it dies the
key disappears after the lease's TTL. Clients read the prefix and watch it
(:class:`EtcdMembership`).

Failure policy: the store must never fail a request because etcd is down. A running
:class:`EtcdMembership` keeps serving the last set it saw while etcd is unreachable, logs one
warning per outage, and re-reads the prefix when etcd is back. Only the constructors and
one-shot calls raise :class:`~kvpool.cluster.etcd.EtcdError`, so that a misconfigured endpoint
is loud at start.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from kvpool.cluster.etcd import (
    GRPC_NOT_FOUND,
    EtcdClient,
    EtcdError,
    KeyValue,
    WatchResponse,
    WatchStream,
)

__all__ = [
    "EtcdMembership",
    "Membership",
    "NodeInfo",
    "NodeRegistration",
    "StaticMembership",
    "list_nodes",
    "nodes_prefix",
    "parse_address",
    "registration_key",
]

log = logging.getLogger(__name__)

# Reconnect backoff of the watcher and the keepalive loop (seconds), with ±20% jitter.
_BACKOFF_MIN_S = 0.1
_BACKOFF_MAX_S = 2.0
# A watch stream that has been silent this long is checked with a read on its endpoint, so a
# member that hangs (rather than closing the connection) is noticed.
_WATCH_IDLE_CHECK_S = 5.0

OnChange = Callable[[list["NodeInfo"]], None]


def _check_name(what: str, name: str) -> str:
    if not name or "/" in name or name != name.strip():
        raise ValueError(f"{what} {name!r}: must be non-empty, without '/' or surrounding "
                         "whitespace")
    return name


def nodes_prefix(cluster: str) -> str:
    """``/kvpool/<cluster>/nodes/``; ValueError for an empty name or one containing '/'."""
    return f"/kvpool/{_check_name('cluster name', cluster)}/nodes/"


def registration_key(cluster: str, node_id: str) -> str:
    """The etcd key a node registers its address and lease under."""
    return nodes_prefix(cluster) + _check_name("node id", node_id)


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6addr]:port"`` → ``(host, port)``; ValueError if malformed."""
    host, sep, port_text = address.strip().rpartition(":")
    if not sep or not host:
        raise ValueError(f"node address {address!r}: expected host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_text)
    except ValueError as exc:
        raise ValueError(f"node address {address!r}: port is not a number") from exc
    if not 0 < port < 65536:
        raise ValueError(f"node address {address!r}: port out of range")
    return host, port


@dataclass(frozen=True)
class NodeInfo:
    """A storage node as registered in etcd (the key's value is this, as JSON).

    Raises ValueError for an empty or '/'-containing ``node_id``, an empty host or a port
    outside 1..65535.
    """

    node_id: str
    host: str
    port: int

    def __post_init__(self) -> None:
        _check_name("node id", self.node_id)
        if not self.host:
            raise ValueError(f"node {self.node_id!r}: empty host")
        if isinstance(self.port, bool) or not isinstance(self.port, int) \
                or not 0 < self.port < 65536:
            raise ValueError(f"node {self.node_id!r}: bad port {self.port!r}")

    def address(self) -> str:
        """``"host:port"`` (IPv6 hosts in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def to_json(self) -> bytes:
        """The value stored in etcd."""
        return json.dumps({"node_id": self.node_id, "host": self.host, "port": self.port},
                          sort_keys=True).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes | str) -> NodeInfo:
        """Parse :meth:`to_json`'s output; ValueError if it is not a valid node record."""
        try:
            doc: Any = json.loads(data)
        except ValueError as exc:
            raise ValueError(f"node record is not JSON: {data[:100]!r}") from exc
        if not isinstance(doc, dict):
            raise ValueError(f"node record is not a JSON object: {data[:100]!r}")
        try:
            return cls(node_id=str(doc["node_id"]), host=str(doc["host"]), port=doc["port"])
        except KeyError as exc:
            raise ValueError(f"node record lacks {exc.args[0]!r}: {data[:100]!r}") from exc

    @classmethod
    def from_address(cls, address: str, node_id: str | None = None) -> NodeInfo:
        """A node from ``"host:port"``; its id is the address unless given."""
        host, port = parse_address(address)
        shown = f"[{host}]" if ":" in host else host
        return cls(node_id=node_id or f"{shown}:{port}", host=host, port=port)


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


def _sorted(nodes: Iterable[NodeInfo]) -> list[NodeInfo]:
    return sorted(nodes, key=lambda n: n.node_id)


@runtime_checkable
class Membership(Protocol):
    """The live storage nodes, as placement sees them."""

    def live_nodes(self) -> list[NodeInfo]:
        """The live nodes sorted by node_id. Never blocks on the network, never raises."""
        ...

    def close(self) -> None:
        """Stop following membership; idempotent."""
        ...


class StaticMembership:
    """A fixed node list (embedded and small deployments): ``["host:port", ...]``.

    Each node's id is its address. Duplicates collapse. Raises ValueError for a malformed
    address.
    """

    def __init__(self, nodes: Iterable[str | NodeInfo]) -> None:
        by_id: dict[str, NodeInfo] = {}
        for item in nodes:
            node = item if isinstance(item, NodeInfo) else NodeInfo.from_address(item)
            by_id[node.node_id] = node
        self._nodes = _sorted(by_id.values())

    def live_nodes(self) -> list[NodeInfo]:
        """The configured nodes, sorted by node_id."""
        return list(self._nodes)

    def close(self) -> None:
        """Nothing to stop."""

    def __enter__(self) -> StaticMembership:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
    """Live nodes of ``cluster`` from etcd, kept current by a watch in a daemon thread.

    The constructor reads ``/kvpool/<cluster>/nodes/`` once and raises
    :class:`~kvpool.cluster.etcd.EtcdError` if no endpoint answers (ValueError for malformed
    endpoints or cluster name). From then on nothing raises: :meth:`live_nodes` returns the
    last set seen without touching the network; when etcd becomes unreachable the thread logs
    one warning, keeps that set, and retries with backoff (0.1 s doubling to 2 s); once etcd
    answers it re-reads the prefix and watches from the revision of that read, so changes
    made meanwhile (including a restart with lost data) are picked up.

    ``on_change`` is called from the watch thread with the new sorted list each time the set
    changes (not for the initial read); an exception it raises is logged and ignored.
    """

    def __init__(self, endpoints: Sequence[str], cluster: str,
                 on_change: OnChange | None = None, timeout_s: float = 2.0) -> None:
        self.cluster = cluster
        self._prefix = nodes_prefix(cluster).encode("utf-8")
        self._client = EtcdClient(endpoints, timeout_s)
        self._on_change = on_change
        self._lock = threading.Lock()
        self._nodes: dict[bytes, NodeInfo] = {}
        self._view: list[NodeInfo] = []
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
        kvs, revision = self._client.get_prefix(self._prefix)
        nodes = {kv.key: node for kv in kvs if (node := _node_from_kv(self._prefix, kv))}
        with self._lock:
            self._nodes = nodes
        self._publish(notify)
        return revision

    def _publish(self, notify: bool) -> None:
        with self._lock:
            view = _sorted(self._nodes.values())
            if view == self._view:
                return
            self._view = view
        if notify and self._on_change is not None:
            try:
                self._on_change(list(view))
            except Exception:
                log.exception("kvpool membership: on_change callback failed")

    def _apply(self, msg: WatchResponse) -> None:
        with self._lock:
            for event in msg.events:
                if event.type == "DELETE":
                    self._nodes.pop(event.kv.key, None)
                elif node := _node_from_kv(self._prefix, event.kv):
                    self._nodes[event.kv.key] = node
                else:
                    self._nodes.pop(event.kv.key, None)
        self._publish(notify=True)

    def _run(self) -> None:
        backoff = _Backoff()
        warned = False
        need_range = False  # the constructor just read
        while not self._stop.is_set():
            try:
                if need_range:
                    self._revision = self._resync(notify=True)
                need_range = True  # whatever ends this watch, re-read before the next one
                stream = self._client.watch_prefix(self._prefix, self._revision + 1)
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
                                    len(self.live_nodes()))
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
                                len(self.live_nodes()), exc)
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


class NodeRegistration:
    """Keeps ``node`` registered in ``cluster`` while this process is alive.

    :meth:`start` grants a lease of ``ttl_s`` (rounded up to whole seconds; etcd may raise it
    to its minimum), puts the node's key with it, and starts a daemon thread that refreshes the
    lease every ``ttl_s / 3``. If the lease is lost (it expired while etcd was unreachable, or
    etcd came back without its data) the thread grants a new one and puts the key again. While
    etcd is unreachable it logs one warning and retries every second or so; it never raises.
    If the process dies, the key disappears after the TTL.
    """

    def __init__(self, endpoints: Sequence[str], cluster: str, node: NodeInfo,
                 ttl_s: float = 10.0, timeout_s: float = 2.0) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        self.node = node
        self.cluster = cluster
        self.key = registration_key(cluster, node.node_id)
        self.ttl_s = float(ttl_s)
        self._client = EtcdClient(endpoints, timeout_s)
        self._lock = threading.Lock()
        self._lease: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def lease_id(self) -> int | None:
        """The current lease, None before start(), after close() or while re-registering."""
        with self._lock:
            return self._lease

    def start(self) -> NodeRegistration:
        """Register and start the keepalive thread; returns self.

        Raises EtcdError if etcd cannot be reached or refuses the lease or the put (nothing is
        left registered then), RuntimeError if already started or closed.
        """
        with self._lock:
            if self._closed or self._thread is not None:
                raise RuntimeError(f"registration of {self.node.node_id!r} already "
                                   f"{'closed' if self._closed else 'started'}")
            self._thread = threading.Thread(target=self._run,
                                            name=f"kvpool-registration-{self.node.node_id}",
                                            daemon=True)
        try:
            self._register()
        except BaseException:
            with self._lock:
                self._thread = None
            raise
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the keepalive thread and revoke the lease, so the node disappears at once.

        Idempotent. Never raises: if etcd cannot be reached the failure is logged and the key
        expires after the TTL instead.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is None:
            return
        try:
            self._client.lease_revoke(lease)
        except EtcdError as exc:
            log.warning("kvpool registration %s: could not revoke lease; the node stays listed "
                        "until its TTL (%.0f s) runs out: %s", self.key, self.ttl_s, exc)

    def __enter__(self) -> NodeRegistration:
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _register(self) -> None:
        lease, _ = self._client.lease_grant(max(1, math.ceil(self.ttl_s)))
        try:
            self._client.put(self.key, self.node.to_json(), lease=lease)
        except EtcdError:
            with contextlib.suppress(EtcdError):  # if not, it expires on its own
                self._client.lease_revoke(lease)
            raise
        with self._lock:
            self._lease = lease

    def _keepalive(self, lease: int) -> int:
        try:
            return self._client.lease_keepalive(lease)
        except EtcdError as exc:
            if exc.code == GRPC_NOT_FOUND:
                return 0
            raise

    def _run(self) -> None:
        interval = self.ttl_s / 3
        retry = min(interval, 1.0)
        warned = False
        wait = interval
        while not self._stop.wait(wait):
            try:
                lease = self.lease_id
                if lease is None:
                    self._register()
                    log.warning("kvpool registration %s: registered again", self.key)
                elif self._keepalive(lease) <= 0:
                    log.warning("kvpool registration %s: lease %x was lost, registering again",
                                self.key, lease)
                    with self._lock:
                        self._lease = None
                    self._register()
                if warned:
                    log.info("kvpool registration %s: etcd reachable again", self.key)
                    warned = False
                wait = interval
            except EtcdError as exc:
                if not warned:
                    log.warning("kvpool registration %s: etcd unreachable, retrying: %s",
                                self.key, exc)
                    warned = True
                else:
                    log.debug("kvpool registration %s: still unreachable: %s", self.key, exc)
                wait = retry
            except Exception:
                log.exception("kvpool registration %s: keepalive thread error", self.key)
                wait = retry


def list_nodes(endpoints: Sequence[str], cluster: str, timeout_s: float = 2.0) -> list[NodeInfo]:
    """The nodes registered in ``cluster`` right now, sorted by node_id (one range read).

    Raises EtcdError if etcd cannot be reached, ValueError for malformed endpoints or cluster
    name. Keys whose value is not a valid node record are skipped with a warning.
    """
    prefix = nodes_prefix(cluster).encode("utf-8")
    kvs, _ = EtcdClient(endpoints, timeout_s).get_prefix(prefix)
    return _sorted(node for kv in kvs if (node := _node_from_kv(prefix, kv)))
