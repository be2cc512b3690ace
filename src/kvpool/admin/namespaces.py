"""``kvpool admin invalidate``: drop exactly some namespaces' chunks on every node.

By id (``NAMESPACE``, 32 hex digits, as STATS lists it), or ``--model M [--tenant T]
[--revision R]``: every namespace a node lists in its STATS with that model (and tenant,
revision). A node lists the namespaces declared on it since it started (its registry, up to
server.max_namespaces); a namespace only on SSD since a restart, declared by no client since,
is known by id only and matched by no ``--model``. Each id is then invalidated on every node
(INVALIDATE without a declaration; the node checks the token: the admin token, or auth off,
may drop any namespace, a tenant token only its tenants' namespaces the node knows).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from kvpool.admin.common import (
    FAILED,
    OK,
    USAGE,
    AdminError,
    NodeFailure,
    add_config_argument,
    cluster_nodes,
    cluster_of,
    command,
    load,
    on_nodes,
    print_json,
)
from kvpool.cluster.membership import NodeInfo
from kvpool.config import ClusterConfig
from kvpool.net.connection import NodeConnection


def add_arguments(sub: Any) -> None:
    p = sub.add_parser("invalidate", help="drop every chunk of a namespace (by id, or every "
                       "namespace of a model) on every node")
    add_config_argument(p)
    p.add_argument("namespace", nargs="?", help="namespace id: 32 hex digits")
    p.add_argument("--model", help="every namespace the nodes know of this model")
    p.add_argument("--tenant", help="with --model: only this tenant's")
    p.add_argument("--revision", help="with --model: only this revision")
    p.add_argument("--json", action="store_true", help="print JSON instead of lines")
    p.set_defaults(func=command(admin_invalidate))


def _target(args: argparse.Namespace) -> bytes | None:
    """The id asked for, or None for --model. AdminError(2) for a bad combination."""
    if (args.namespace is None) == (args.model is None):
        raise AdminError("name exactly one of NAMESPACE (an id) or --model", USAGE)
    if args.namespace is None:
        return None
    if args.tenant is not None or args.revision is not None:
        raise AdminError("--tenant and --revision go with --model, not with an id", USAGE)
    try:
        ns_id = bytes.fromhex(args.namespace)
    except ValueError:
        ns_id = b""
    if len(ns_id) != 16:
        raise AdminError(f"namespace id {args.namespace!r}: expected 32 hex digits", USAGE)
    return ns_id


def matching(cluster: ClusterConfig, nodes: list[NodeInfo], model: str, tenant: str | None,
             revision: str | None) -> tuple[dict[bytes, dict[str, Any]], dict[str, str]]:
    """The namespaces the nodes list with this model (tenant, revision), by id, and the
    nodes that could not say (node id: why)."""
    found: dict[bytes, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    for node_id, stats in on_nodes(cluster, nodes, NodeConnection.stats).items():
        if isinstance(stats, NodeFailure):
            failed[node_id] = str(stats)
            continue
        listed = stats.get("namespaces")
        if not isinstance(listed, list):
            failed[node_id] = "lists no namespaces in its STATS (a kvpool older than admin " \
                              "invalidate?)"
            continue
        for ns in listed:
            if ns.get("model") == model and tenant in (None, ns.get("tenant")) \
                    and revision in (None, ns.get("revision")):
                found.setdefault(bytes.fromhex(ns["id"]), ns)
    return found, failed


def _invalidate(ns_id: bytes) -> Callable[[NodeConnection], int]:
    return lambda conn: conn.invalidate_id(ns_id)


def admin_invalidate(args: argparse.Namespace) -> int:
    """Invalidate on every node; prints what each node dropped. Exit 1 when a node could not
    be asked (or refused), or ``--model`` matched nothing."""
    ns_id = _target(args)
    cluster = cluster_of(load(args))
    nodes = cluster_nodes(cluster)
    if not nodes:
        raise AdminError(f"cluster {cluster.name!r} has no nodes")
    failed: dict[str, str] = {}
    if ns_id is not None:
        targets: dict[bytes, dict[str, Any]] = {ns_id: {"id": ns_id.hex()}}
    else:
        targets, failed = matching(cluster, nodes, args.model, args.tenant, args.revision)
        if not targets:
            for node_id, why in failed.items():
                print(f"kvpool admin: node {node_id}: {why}")
            raise AdminError(f"no node knows a namespace of model {args.model!r}"
                             + (f", tenant {args.tenant!r}" if args.tenant is not None else "")
                             + (f", revision {args.revision!r}" if args.revision is not None
                                else "")
                             + " (nodes list those declared since they started; name an id "
                             "to drop one known by id only)")
    results: list[dict[str, Any]] = []
    for target, info in targets.items():
        dropped = on_nodes(cluster, nodes, _invalidate(target))
        for node_id, count in dropped.items():
            row = {"node_id": node_id, "namespace": target.hex(), "model": info.get("model"),
                   "tenant": info.get("tenant"), "dropped": None, "error": None}
            if isinstance(count, NodeFailure):
                row["error"] = str(count)
            else:
                row["dropped"] = count
            results.append(row)
    bad = failed or any(r["error"] for r in results)
    if args.json:
        print_json({"invalidated": results, "unasked": failed})
        return FAILED if bad else OK
    for r in results:
        what = f"namespace {r['namespace']}" + (f" ({r['model']}, tenant {r['tenant']!r})"
                                                if r["model"] is not None else "")
        if r["error"]:
            print(f"{r['node_id']}: {what}: FAILED: {r['error']}")
        else:
            print(f"{r['node_id']}: {what}: dropped {r['dropped']} chunk copies")
    for node_id, why in failed.items():
        print(f"{node_id}: not asked for its namespaces: {why}")
    return FAILED if bad else OK
