"""``kvpool admin drain NODE`` / ``undrain NODE``: stop (and resume) placing new chunks on a
node before maintenance, while reads of what it holds continue.

A drain is the etcd key ``/kvpool/<cluster>/drained/<node_id>`` (cluster/membership.py), put
without a lease so it outlives restarts of the node until ``undrain`` deletes it. Every client
watches it (cluster/etcd_membership.py) and places writes over the nodes that are not drained
(net/client.py); the node watches it too and shows ``draining`` in its STATS. With a static
node list there is no flag every client would see: both commands refuse (exit 2).

A drained node copies each chunk it holds to the nodes that own it without it (server/repair.py)
and reports its progress under ``/kvpool/<cluster>/drain_status/<node_id>``. ``drain --wait``
waits (up to ``--timeout``) until the node reports ``done`` and prints how many chunks it
copied: the node can then be stopped without a miss. It exits 1 if the node reports no
progress in time (``blocked``: no undrained node to copy to).
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from typing import Any

from kvpool.admin.common import OK, AdminError, cluster_nodes, command
from kvpool.admin.node_key import add_node_command, etcd_client, etcd_cluster, etcd_errors, node_key
from kvpool.config import ClusterConfig
from kvpool.server.drain_status import drain_status_key


def add_arguments(sub: Any) -> None:
    drain = add_node_command(sub, "drain", help="place no new chunks on a node (reads "
                             "continue); needs etcd", force_help="drain a node that is not "
                             "registered now (down, or not started)")
    drain.add_argument("--wait", action="store_true",
                       help="wait until the node has copied its chunks to their new owners")
    drain.add_argument("--timeout", type=float, default=600.0,
                       help="seconds --wait waits at most (default 600)")
    drain.set_defaults(func=command(admin_drain))
    undrain = add_node_command(sub, "undrain", help="place new chunks on a drained node "
                               "again", node_help="node id")
    undrain.set_defaults(func=command(admin_undrain))


def _etcd_cluster(args: argparse.Namespace) -> ClusterConfig:
    return etcd_cluster(args, "drain needs etcd (cluster.etcd): with a static cluster.nodes "
                        "list no flag reaches every client; take the node out of each "
                        "client's cluster.nodes instead")


def _key(cluster: ClusterConfig, node_id: str) -> str:
    from kvpool.cluster.membership import drained_key
    return node_key(drained_key, cluster, node_id)


def admin_drain(args: argparse.Namespace) -> int:
    """Put the drain key. Exit 1 if the node is not registered (without --force) or etcd
    cannot be reached."""
    cluster = _etcd_cluster(args)
    key = _key(cluster, args.node)
    registered = [n.node_id for n in cluster_nodes(cluster)]
    if args.node not in registered and not args.force:
        raise AdminError(f"node {args.node!r} is not registered in cluster {cluster.name!r} "
                         f"(registered: {', '.join(registered) or 'none'}); --force drains "
                         "it anyway")
    value = json.dumps({"since": time.time(), "by": socket.gethostname()}).encode()
    etcd = etcd_client(cluster)
    status_key = drain_status_key(cluster.name, args.node)
    with etcd_errors():
        if etcd.get(key) is None:  # a new drain: no progress of an earlier one counts
            etcd.delete(status_key)
        etcd.put(key, value)
    print(f"node {args.node} drained: clients place no new chunks on it once their etcd "
          f"watch sees {key} (milliseconds, plus cluster.live_cache_s); reads of what it "
          f"holds continue. Undo with `kvpool admin undrain {args.node}`.", flush=True)
    if not args.wait:
        print(f"It now copies its chunks to their new owners; `kvpool admin drain {args.node} "
              "--wait` waits until it is done.")
        return OK
    status = _wait_done(etcd, status_key, args.timeout)
    print(f"node {args.node} copied {status.get('copied', 0)} chunks to their new owners "
          f"({status.get('failed', 0)} copies failed and were retried; "
          f"{status.get('chunks', 0)} chunks checked): it can be stopped now.")
    return OK


def _wait_done(etcd: Any, status_key: str, timeout_s: float) -> dict[str, Any]:
    """Poll the node's drain status until ``done``. Raises AdminError on timeout (with the
    last status seen) or when etcd cannot be reached."""
    deadline = time.monotonic() + timeout_s
    status: dict[str, Any] = {}
    while True:
        with etcd_errors():
            kv = etcd.get(status_key)
        if kv is not None:
            try:
                status = json.loads(kv.value)
            except ValueError:
                status = {}
            if status.get("state") == "done":
                return status
        if time.monotonic() >= deadline:
            raise AdminError(f"the node did not report its copies done within {timeout_s:g} s "
                             f"(last report: {status or 'none'}; a node with no undrained "
                             "node to copy to reports blocked)")
        time.sleep(0.2)


def admin_undrain(args: argparse.Namespace) -> int:
    """Delete the drain key (exit 0 also when the node was not drained)."""
    cluster = _etcd_cluster(args)
    key = _key(cluster, args.node)
    with etcd_errors():
        etcd = etcd_client(cluster)
        deleted = etcd.delete(key)
        etcd.delete(drain_status_key(cluster.name, args.node))
    print(f"node {args.node} undrained: new chunks are placed on it again" if deleted
          else f"node {args.node} was not drained")
    return OK
