"""Cluster membership: which storage nodes are live (etcd leases, or a static list).

See DESIGN.md §6. :class:`EtcdMembership` follows ``/kvpool/<cluster>/nodes/`` in etcd,
:class:`NodeRegistration` keeps one node listed there, :class:`StaticMembership` is a fixed
list for deployments without etcd.
"""

from kvpool.cluster.etcd import EtcdClient, EtcdError
from kvpool.cluster.membership import (
    EtcdMembership,
    Membership,
    NodeInfo,
    NodeRegistration,
    StaticMembership,
    list_nodes,
    nodes_prefix,
)

__all__ = [
    "EtcdClient",
    "EtcdError",
    "EtcdMembership",
    "Membership",
    "NodeInfo",
    "NodeRegistration",
    "StaticMembership",
    "list_nodes",
    "nodes_prefix",
]
