"""What every ``kvpool admin`` command shares: loading the config, finding the cluster's
nodes, asking each node something on its own connection, and the exit codes.

Exit codes: 0 ok; 1 a failure the operator must look at (a node unreachable or refusing,
etcd unreachable, damage found); 2 bad usage or bad config. An expected failure is one line
on stderr (``kvpool admin: ...``), never a traceback: commands raise :class:`AdminError` and
:func:`command` turns it into that line and the code.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvpool.cluster.membership import NodeInfo
from kvpool.config import ClusterConfig, Config, load_config
from kvpool.errors import ConfigError, KVPoolError
from kvpool.net.connection import NodeConnection, open_connection
from kvpool.net.protocol import ProtocolError, RemoteError
from kvpool.net.tls import client_tls

OK, FAILED, USAGE = 0, 1, 2
#: Admin requests may take longer than the data path's (an invalidation walks DRAM).
MIN_REQUEST_TIMEOUT_S = 10.0
ETCD_TIMEOUT_S = 2.0  # per etcd endpoint tried
T = TypeVar("T")


class AdminError(Exception):
    """An expected failure: ``message`` is printed as one line, ``code`` is the exit code."""

    def __init__(self, message: str, code: int = FAILED) -> None:
        super().__init__(message)
        self.code = code


def command(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Wrap a command: AdminError becomes its line on stderr and its exit code."""
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except AdminError as exc:
            print(f"kvpool admin: {exc}", file=sys.stderr)
            return exc.code
    return run


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file (default: $KVPOOL_CONFIG); its cluster "
                        "section names the nodes (etcd or a static list) and cluster.token "
                        "the token to use (the nodes' server.admin_token for node-wide views)")


def load(args: argparse.Namespace) -> Config:
    """The config ``--config`` names. Raises AdminError(2) for a bad one."""
    try:
        return load_config(args.config)
    except ConfigError as exc:
        raise AdminError(str(exc), USAGE) from None


def cluster_of(cfg: Config) -> ClusterConfig:
    """``cfg.cluster``; AdminError(2) when it names no nodes."""
    if not cfg.cluster.enabled:
        raise AdminError("no cluster configured (set cluster.etcd or cluster.nodes)", USAGE)
    return cfg.cluster


def cluster_nodes(cluster: ClusterConfig) -> list[NodeInfo]:
    """The nodes registered in etcd now (or the static list), sorted by id. Raises
    AdminError(1) if etcd cannot be reached, AdminError(2) for a malformed address."""
    try:
        if cluster.etcd:
            from kvpool.cluster.etcd_membership import list_nodes
            return list_nodes(cluster.etcd, cluster.name, ETCD_TIMEOUT_S)
        from kvpool.cluster.membership import StaticMembership
        return StaticMembership(cluster.nodes).live_nodes()
    except ValueError as exc:
        raise AdminError(f"cluster: {exc}", USAGE) from None
    except KVPoolError as exc:
        raise AdminError(str(exc)) from None


def cluster_read(cluster: ClusterConfig) -> Any:
    """A :class:`~kvpool.cluster.etcd_membership.ClusterRead` of the cluster now: from etcd,
    or the static list (every node expected, none drained). Raises as
    :func:`cluster_nodes`."""
    from kvpool.cluster.etcd_membership import ClusterRead, read_cluster
    try:
        if cluster.etcd:
            return read_cluster(cluster.etcd, cluster.name, ETCD_TIMEOUT_S)
        from kvpool.cluster.membership import StaticMembership
        nodes = StaticMembership(cluster.nodes).live_nodes()
        return ClusterRead(nodes=nodes, expected={n.node_id: n.address() for n in nodes},
                           drained=frozenset())
    except ValueError as exc:
        raise AdminError(f"cluster: {exc}", USAGE) from None
    except KVPoolError as exc:
        raise AdminError(str(exc)) from None


def pick(nodes: list[NodeInfo], node_id: str | None, cluster: ClusterConfig) -> list[NodeInfo]:
    """``nodes``, or only ``node_id`` (AdminError(1) if it is not among them)."""
    if node_id is None:
        return nodes
    chosen = [n for n in nodes if n.node_id == node_id]
    if not chosen:
        known = ", ".join(n.node_id for n in nodes) or "none"
        raise AdminError(f"node {node_id!r} is not in cluster {cluster.name!r} (nodes: "
                         f"{known})")
    return chosen


def on_node(cluster: ClusterConfig, node: NodeInfo, fn: Callable[[NodeConnection], T]) -> T:
    """Run ``fn`` on a fresh connection to ``node`` (cluster.token, the cluster's timeouts,
    at least MIN_REQUEST_TIMEOUT_S per request). Raises NodeFailure naming what went wrong."""
    try:
        conn = open_connection(node.address(), cluster.token, cluster.connect_timeout_s,
                               max(cluster.request_timeout_s, MIN_REQUEST_TIMEOUT_S),
                               cluster.socket_buffer_bytes, client_tls(cluster.tls))
    except ConfigError as exc:  # a cluster.tls file that cannot be loaded
        raise NodeFailure(str(exc)) from None
    except OSError as exc:
        raise NodeFailure(f"unreachable at {node.address()}: {exc}") from None
    except RemoteError as exc:
        raise NodeFailure(f"refused the token: {exc}") from None
    try:
        return fn(conn)
    except RemoteError as exc:
        raise NodeFailure(f"refused: {exc}") from None
    except (OSError, ProtocolError) as exc:
        raise NodeFailure(f"failed at {node.address()}: {exc}") from None
    finally:
        conn.close()


class NodeFailure(Exception):
    """A node could not be asked (unreachable, refused, broke the protocol)."""


def on_nodes(cluster: ClusterConfig, nodes: list[NodeInfo],
             fn: Callable[[NodeConnection], T]) -> dict[str, T | NodeFailure]:
    """``on_node`` for every node, in parallel; a failure is the NodeFailure, per node."""
    def one(node: NodeInfo) -> T | NodeFailure:
        try:
            return on_node(cluster, node, fn)
        except NodeFailure as exc:
            return exc
    if not nodes:
        return {}
    with ThreadPoolExecutor(min(16, len(nodes))) as pool:
        return dict(zip((n.node_id for n in nodes), pool.map(one, nodes), strict=True))


def drained_ids(cluster: ClusterConfig) -> frozenset[str]:
    """Node ids drained in etcd now (none with a static list). AdminError(1) if etcd cannot
    be reached."""
    if not cluster.etcd:
        return frozenset()
    from kvpool.cluster.etcd import EtcdClient
    from kvpool.cluster.membership import drained_prefix
    prefix = drained_prefix(cluster.name)
    try:
        kvs, _ = EtcdClient(cluster.etcd, ETCD_TIMEOUT_S).get_prefix(prefix)
    except KVPoolError as exc:
        raise AdminError(str(exc)) from None
    return frozenset(kv.key.decode("utf-8", "replace")[len(prefix):] for kv in kvs)


def console(width: int) -> Any:
    """A rich Console: the terminal's width, or ``width`` columns when stdout is not a
    terminal (rich would wrap tables at 80 there)."""
    from rich.console import Console
    return Console() if sys.stdout.isatty() else Console(width=width)


def print_json(doc: Any) -> None:
    import json
    print(json.dumps(doc, indent=2, default=str))
