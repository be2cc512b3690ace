"""Cluster membership: which storage nodes are live (etcd leases, or a static list).

See DESIGN.md §6. :class:`EtcdMembership` follows ``/kvpool/<cluster>/nodes/`` in etcd,
:class:`NodeRegistration` keeps one node listed there, :class:`StaticMembership` is a fixed
list for deployments without etcd.

Modules, one job each: ``membership`` (the node record, key layout, the Membership protocol,
the static list), ``etcd_membership`` (the watched view), ``registration`` (lease and
keepalive), ``etcd`` (the gateway client, with ``etcd_wire`` and ``etcd_watch``).
"""

from kvpool.cluster.etcd import EtcdClient, EtcdError
from kvpool.cluster.etcd_membership import EtcdMembership, list_nodes
from kvpool.cluster.membership import Membership, NodeInfo, StaticMembership, nodes_prefix
from kvpool.cluster.registration import NodeRegistration

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
