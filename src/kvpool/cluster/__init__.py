"""Cluster membership: which storage nodes are live (etcd leases, or a static list)."""

from kvpool.cluster.etcd import EtcdClient, EtcdError

__all__ = ["EtcdClient", "EtcdError"]
