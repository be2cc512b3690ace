"""``kvpool admin``: the subcommands, and ``nodes`` and ``stats`` (a read of every node).

``invalidate`` lives in namespaces.py, ``drain`` / ``undrain`` in drain.py, ``forget`` in
forget.py, ``verify`` in verify.py; exit codes and the shared helpers in common.py
(docs/operations.md, "Admin commands").
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvpool.admin.common import (
    FAILED,
    OK,
    NodeFailure,
    add_config_argument,
    cluster_nodes,
    cluster_of,
    cluster_read,
    command,
    console,
    load,
    on_nodes,
    pick,
    print_json,
)
from kvpool.net.connection import NodeConnection


def add_admin_arguments(parser: argparse.ArgumentParser) -> None:
    from kvpool.admin import drain, forget, namespaces, verify
    sub = parser.add_subparsers(dest="admin_command", required=True)
    nodes = sub.add_parser("nodes", help="list the cluster's nodes (etcd or the static list) "
                           "with their state (live, missing, draining) and stats; exit 1 "
                           "when an expected node is missing")
    add_config_argument(nodes)
    nodes.add_argument("--json", action="store_true", help="print JSON instead of a table")
    nodes.set_defaults(func=command(admin_nodes))
    stats = sub.add_parser("stats", help="one node's or every node's STATS")
    add_config_argument(stats)
    stats.add_argument("--node", help="only this node id")
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    stats.set_defaults(func=command(admin_stats))
    namespaces.add_arguments(sub)
    drain.add_arguments(sub)
    forget.add_arguments(sub)
    verify.add_arguments(sub)


def admin_nodes(args: argparse.Namespace) -> int:
    """Every registered or expected node with its state (kvpool.cluster.states) and a few of
    its figures; a registered node that does not answer is listed as down. Exit 1 (and one
    line on stderr naming them) when an expected node is missing, else 0."""
    from kvpool.cluster.states import MISSING, node_states
    cluster = cluster_of(load(args))
    read = cluster_read(cluster)
    nodes = {n.node_id: n for n in read.nodes}
    states = node_states(nodes, read.expected, read.drained)
    stats = on_nodes(cluster, list(nodes.values()), NodeConnection.stats)
    rows = []
    for node_id, state in states.items():
        node = nodes.get(node_id)
        answer = stats.get(node_id)
        st = None if answer is None or isinstance(answer, NodeFailure) else answer
        dram, ssd = (st or {}).get("dram", {}), (st or {}).get("ssd", {})
        rows.append({"node_id": node_id, "state": state,
                     "address": node.address() if node else read.expected.get(node_id, ""),
                     "incarnation": node.incarnation if node else None,
                     "up": st is not None, "drained": node_id in read.drained,
                     "dram_entries": dram.get("entries"), "dram_used": dram.get("used_bytes"),
                     "ssd_records": ssd.get("records"), "ssd_used": ssd.get("used_bytes"),
                     "uptime_s": (st or {}).get("server", {}).get("uptime_s")})
    missing = [r["node_id"] for r in rows if r["state"] == MISSING]
    if args.json:
        print_json(rows)
    else:
        from rich.table import Table
        table = Table(title=f"kvpool cluster {cluster.name!r}: {len(rows)} nodes")
        for col in ("node", "state", "address", "up", "drained", "DRAM chunks", "DRAM MiB",
                    "SSD chunks", "SSD MiB", "uptime s"):
            table.add_column(col)
        for r in rows:
            table.add_row(r["node_id"], r["state"].upper() if r["state"] == MISSING
                          else r["state"], r["address"], "yes" if r["up"] else "NO",
                          "DRAINED" if r["drained"] else "-", _cell(r["dram_entries"]),
                          _mib(r["dram_used"]), _cell(r["ssd_records"]), _mib(r["ssd_used"]),
                          _cell(r["uptime_s"]))
        console(150).print(table)
    if missing:
        print(f"kvpool admin: {len(missing)} expected node(s) missing: {', '.join(missing)} "
              "(not registered; `kvpool admin forget NODE` if one is gone for good)",
              file=sys.stderr)
        return FAILED
    return OK


def admin_stats(args: argparse.Namespace) -> int:
    """STATS of every node (or ``--node``'s): JSON ``{node_id: stats}`` (``{"error": ...}``
    for a node that could not be asked), or a table with a column per node and a row per
    figure. Exit 1 if a node could not be asked."""
    cluster = cluster_of(load(args))
    nodes = pick(cluster_nodes(cluster), args.node, cluster)
    stats = on_nodes(cluster, nodes, NodeConnection.stats)
    failed = {n: str(s) for n, s in stats.items() if isinstance(s, NodeFailure)}
    if args.json:
        print_json({n: {"error": failed[n]} if n in failed else s for n, s in stats.items()})
        return FAILED if failed else OK
    from rich.table import Table
    flat = {n: _flatten(s) for n, s in stats.items() if not isinstance(s, NodeFailure)}
    table = Table(title=f"kvpool cluster {cluster.name!r}: STATS of {len(nodes)} node(s)")
    table.add_column("figure")
    for node in nodes:
        table.add_column(node.node_id, justify="right")
    names = sorted({name for figures in flat.values() for name in figures},
                   key=lambda k: (not k.startswith("server."), k))  # the node's own first
    if failed:
        table.add_row("error", *(failed.get(n.node_id, "") for n in nodes))
    for name in names:
        table.add_row(name, *(_cell(flat.get(n.node_id, {}).get(name)) for n in nodes))
    console(max(100, 40 + 24 * len(nodes))).print(table)
    return FAILED if failed else OK


def _flatten(doc: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested STATS as ``a.b.c`` figures; a list (the namespaces) becomes its length."""
    out: dict[str, Any] = {}
    for key, value in doc.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        elif isinstance(value, list):
            out[name] = len(value)
        else:
            out[name] = value
    return out


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def _mib(value: Any) -> str:
    return f"{value / 2**20:.1f}" if isinstance(value, int) else "-"
