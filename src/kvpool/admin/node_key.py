"""What the admin commands that put or delete one node's key in etcd share (``drain``,
``undrain``, ``forget``): the sub-command with its ``--config`` and ``node`` arguments, the
cluster (which must use etcd), the node's key, and etcd errors as AdminError (exit 1)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from kvpool.admin.common import (
    ETCD_TIMEOUT_S,
    USAGE,
    AdminError,
    add_config_argument,
    cluster_of,
    load,
)
from kvpool.config import ClusterConfig
from kvpool.errors import KVPoolError

if TYPE_CHECKING:
    from kvpool.cluster.etcd import EtcdClient

NODE_HELP = "node id (as `kvpool admin nodes` lists it)"


def add_node_command(sub: Any, name: str, help: str, node_help: str = NODE_HELP,
                     force_help: str | None = None) -> argparse.ArgumentParser:
    """The sub-command ``name NODE [--config FILE]``, with ``--force`` when ``force_help`` is
    given; the caller adds its other options."""
    parser: argparse.ArgumentParser = sub.add_parser(name, help=help)
    add_config_argument(parser)
    parser.add_argument("node", help=node_help)
    if force_help is not None:
        parser.add_argument("--force", action="store_true", help=force_help)
    return parser


def etcd_cluster(args: argparse.Namespace, refusal: str) -> ClusterConfig:
    """The configured cluster. AdminError (exit 2) saying ``refusal`` when it has no etcd, or
    for a bad config."""
    cluster = cluster_of(load(args))
    if not cluster.etcd:
        raise AdminError(refusal, USAGE)
    return cluster


def node_key(make_key: Callable[[str, str], str], cluster: ClusterConfig, node_id: str) -> str:
    """``make_key(cluster name, node id)`` (cluster/membership.py); a malformed node id is
    AdminError (exit 2)."""
    try:
        return make_key(cluster.name, node_id)
    except ValueError as exc:
        raise AdminError(str(exc), USAGE) from None


def etcd_client(cluster: ClusterConfig) -> EtcdClient:
    from kvpool.cluster.etcd import EtcdClient
    return EtcdClient(cluster.etcd, ETCD_TIMEOUT_S)


@contextmanager
def etcd_errors() -> Iterator[None]:
    """Turn an etcd that cannot be reached (KVPoolError) into AdminError (exit 1)."""
    try:
        yield
    except KVPoolError as exc:
        raise AdminError(str(exc)) from None
