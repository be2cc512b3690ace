"""Which storage nodes are live: the node record, its etcd key layout, and a static list.

Layout in etcd (DESIGN.md §6): each node puts ``/kvpool/<cluster>/nodes/<node_id>`` with a JSON
:class:`NodeInfo` value, attached to a lease it keeps alive
(:class:`~kvpool.cluster.registration.NodeRegistration`), only if the key is absent or held by
the same ``identity`` (its cache_dir's: a previous run of the same node). Each run has its own
``incarnation``. When the node stops cleanly it marks its record ``stopping`` and deletes it
(clients drop it at once); when it dies the key disappears after the lease's TTL (clients keep
it for ``cluster.membership_grace_s`` unless requests to it fail). Registering also puts
``/kvpool/<cluster>/expected/<node_id>`` (no lease): the nodes that should be there, until
``kvpool admin forget`` deletes it. ``kvpool admin drain`` puts
``/kvpool/<cluster>/drained/<node_id>`` (no lease: a drain outlives restarts of the node until
``kvpool admin undrain`` deletes it); placement of new chunks skips a drained node, reads still
go to it. Clients read ``/kvpool/<cluster>/``
and watch it (:class:`~kvpool.cluster.etcd_membership.EtcdMembership`); deployments without
etcd use :class:`StaticMembership` (nothing is ever drained there). Placement sees either
through the :class:`Membership` protocol.

Nothing here touches the network; malformed names, addresses and records raise ValueError.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "Membership",
    "NodeInfo",
    "StaticMembership",
    "cluster_prefix",
    "drained_key",
    "drained_prefix",
    "expected_key",
    "expected_prefix",
    "nodes_prefix",
    "parse_address",
    "registration_key",
    "sorted_nodes",
]


def _check_name(what: str, name: str) -> str:
    if not name or "/" in name or name != name.strip():
        raise ValueError(f"{what} {name!r}: must be non-empty, without '/' or surrounding "
                         "whitespace")
    return name


def cluster_prefix(cluster: str) -> str:
    """``/kvpool/<cluster>/``, above every key of the cluster; ValueError for an empty name or
    one containing '/'."""
    return f"/kvpool/{_check_name('cluster name', cluster)}/"


def nodes_prefix(cluster: str) -> str:
    """``/kvpool/<cluster>/nodes/``; ValueError for an empty name or one containing '/'."""
    return cluster_prefix(cluster) + "nodes/"


def drained_prefix(cluster: str) -> str:
    """``/kvpool/<cluster>/drained/``: one key per drained node (any value)."""
    return cluster_prefix(cluster) + "drained/"


def drained_key(cluster: str, node_id: str) -> str:
    """The key whose presence drains ``node_id``; ValueError for a malformed name."""
    return drained_prefix(cluster) + _check_name("node id", node_id)


def expected_prefix(cluster: str) -> str:
    """``/kvpool/<cluster>/expected/``: one key per node that ever registered (no lease)."""
    return cluster_prefix(cluster) + "expected/"


def expected_key(cluster: str, node_id: str) -> str:
    """The key that keeps ``node_id`` in the expected set; ValueError for a malformed name."""
    return expected_prefix(cluster) + _check_name("node id", node_id)


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
    #: Port of the node's /metrics endpoint (server.metrics_port), on ``host``; None: none.
    metrics_port: int | None = None
    #: This run of the node (random per process start); None in records that lack it.
    incarnation: str | None = None
    #: The node's cache_dir identity (kept in the cache_dir, the same across restarts).
    identity: str | None = None
    #: Set by a node that stops cleanly, just before it deletes its key.
    stopping: bool = False

    def __post_init__(self) -> None:
        _check_name("node id", self.node_id)
        if not self.host:
            raise ValueError(f"node {self.node_id!r}: empty host")
        if isinstance(self.port, bool) or not isinstance(self.port, int) \
                or not 0 < self.port < 65536:
            raise ValueError(f"node {self.node_id!r}: bad port {self.port!r}")
        if self.metrics_port is not None and (isinstance(self.metrics_port, bool) or not
                                              isinstance(self.metrics_port, int) or
                                              not 0 < self.metrics_port < 65536):
            raise ValueError(f"node {self.node_id!r}: bad metrics port {self.metrics_port!r}")

    def address(self) -> str:
        """``"host:port"`` (IPv6 hosts in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def to_json(self) -> bytes:
        """The value stored in etcd."""
        doc: dict[str, Any] = {"node_id": self.node_id, "host": self.host, "port": self.port}
        if self.metrics_port is not None:
            doc["metrics_port"] = self.metrics_port
        for name in ("incarnation", "identity"):
            if getattr(self, name) is not None:
                doc[name] = getattr(self, name)
        if self.stopping:
            doc["stopping"] = True
        return json.dumps(doc, sort_keys=True).encode("utf-8")

    def metrics_url(self) -> str | None:
        """``http://host:metrics_port/metrics``, or None when the node serves no metrics."""
        if self.metrics_port is None:
            return None
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.metrics_port}/metrics"

    @classmethod
    def from_json(cls, data: bytes | str) -> NodeInfo:
        """Parse :meth:`to_json`'s output; ValueError if it is not a valid node record.
        ``incarnation``, ``identity`` and ``stopping`` are optional (older records lack
        them)."""
        try:
            doc: Any = json.loads(data)
        except ValueError as exc:
            raise ValueError(f"node record is not JSON: {data[:100]!r}") from exc
        if not isinstance(doc, dict):
            raise ValueError(f"node record is not a JSON object: {data[:100]!r}")
        try:
            return cls(node_id=str(doc["node_id"]), host=str(doc["host"]), port=doc["port"],
                       metrics_port=doc.get("metrics_port"),
                       incarnation=_opt_str(doc.get("incarnation")),
                       identity=_opt_str(doc.get("identity")),
                       stopping=doc.get("stopping") is True)
        except KeyError as exc:
            raise ValueError(f"node record lacks {exc.args[0]!r}: {data[:100]!r}") from exc

    @classmethod
    def from_address(cls, address: str, node_id: str | None = None) -> NodeInfo:
        """A node from ``"host:port"``; its id is the address unless given."""
        host, port = parse_address(address)
        shown = f"[{host}]" if ":" in host else host
        return cls(node_id=node_id or f"{shown}:{port}", host=host, port=port)


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def sorted_nodes(nodes: Iterable[NodeInfo]) -> list[NodeInfo]:
    """``nodes`` sorted by node_id, the order every membership reports."""
    return sorted(nodes, key=lambda n: n.node_id)


@runtime_checkable
class Membership(Protocol):
    """The live storage nodes, as placement sees them."""

    def live_nodes(self) -> list[NodeInfo]:
        """The live nodes sorted by node_id. Never blocks on the network, never raises."""
        ...

    def drained_nodes(self) -> frozenset[str]:
        """Ids of the nodes drained by ``kvpool admin drain`` (live or not): no new chunks
        are placed on them, reads still are. Never blocks on the network, never raises."""
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
        self._nodes = sorted_nodes(by_id.values())

    def live_nodes(self) -> list[NodeInfo]:
        """The configured nodes, sorted by node_id."""
        return list(self._nodes)

    def drained_nodes(self) -> frozenset[str]:
        """Always empty: draining needs etcd (a flag every client sees)."""
        return frozenset()

    def close(self) -> None:
        """Nothing to stop."""

    def __enter__(self) -> StaticMembership:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
