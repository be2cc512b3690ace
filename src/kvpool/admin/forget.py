"""``kvpool admin forget NODE``: take a node out of the expected set for good.

Every node that registers puts ``/kvpool/<cluster>/expected/<node_id>`` (no lease;
cluster/membership.py); while it is not registered it counts as missing (``admin nodes`` exits
1, ``kvpool_cluster_nodes{state="missing"}``). ``forget`` deletes that key, for a node that is
gone for good. A node registered now is refused (it would only put the key again when it
re-registers) unless ``--force``. Needs etcd: a static list has no expected set to edit.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvpool.admin.common import OK, AdminError, cluster_read, command
from kvpool.admin.node_key import add_node_command, etcd_client, etcd_cluster, etcd_errors, node_key


def add_arguments(sub: Any) -> None:
    forget = add_node_command(sub, "forget", help="remove a node from the expected set (it no "
                              "longer counts as missing); needs etcd",
                              force_help="forget a node that is registered now")
    forget.set_defaults(func=command(admin_forget))


def admin_forget(args: argparse.Namespace) -> int:
    """Delete the node's expected-set key. Exit 1 if the node is registered now (without
    --force), is not expected, or etcd cannot be reached; 2 without etcd or for a malformed
    node id."""
    from kvpool.cluster.membership import expected_key
    cluster = etcd_cluster(args, "forget needs etcd (cluster.etcd): a static cluster.nodes "
                           "list has no expected set; edit the list instead")
    key = node_key(expected_key, cluster, args.node)
    read = cluster_read(cluster)
    live = {n.node_id: n for n in read.nodes}
    if args.node in live and not args.force:
        raise AdminError(f"node {args.node!r} is live now at {live[args.node].address()}: "
                         "stop it first (--force forgets it anyway; it is expected again "
                         "when it registers again)")
    if args.node not in read.expected:
        known = ", ".join(sorted(read.expected)) or "none"
        raise AdminError(f"node {args.node!r} is not in the expected set of cluster "
                         f"{cluster.name!r} (expected: {known})")
    with etcd_errors():
        etcd_client(cluster).delete(key)
    print(f"node {args.node} forgotten: no longer expected in cluster {cluster.name!r}")
    return OK
