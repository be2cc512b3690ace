"""``kvpool serve`` and ``kvpool admin nodes``: command-line entry points of the cluster."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvpool.config import Config, load_config
from kvpool.errors import ConfigError, KVPoolError


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file (default: $KVPOOL_CONFIG); sections "
                        "server, cluster, dram, ssd, pool")
    parser.add_argument("--host", help="override server.host")
    parser.add_argument("--port", type=int, help="override server.port (0 = any free port)")
    parser.add_argument("--node-id", help="override server.node_id")
    parser.add_argument("--cache-dir", help="override cache_dir (where the SSD tier lives)")


def _load(args: argparse.Namespace, overrides: dict[str, Any],
          prog: str = "kvpool") -> Config | None:
    try:
        return load_config(args.config, overrides=overrides)
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None


def serve_from_args(args: argparse.Namespace) -> int:
    """``kvpool serve``. Exit 2 with one line on stderr for a setting that must change (bad
    config, tier geometry the media cannot hold, unreachable etcd); 1 for an OS failure at
    start (e.g. the port is taken); 0 after a clean stop."""
    server = {k: v for k, v in (("host", args.host), ("port", args.port),
                                ("node_id", args.node_id)) if v is not None}
    overrides: dict[str, Any] = {"server": server} if server else {}
    if args.cache_dir:
        overrides["cache_dir"] = args.cache_dir
    cfg = _load(args, overrides, "kvpool serve")
    if cfg is None:
        return 2
    from kvpool.server.node import NodeStartError, run
    try:
        return run(cfg)
    except NodeStartError as exc:
        print(f"kvpool serve: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvpool serve: cannot start: {exc}", file=sys.stderr)
        return 1


def add_admin_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="admin_command", required=True)
    nodes = sub.add_parser("nodes", help="list the cluster's nodes (etcd or the static list) "
                           "with their stats")
    nodes.add_argument("--config", help="YAML file (default: $KVPOOL_CONFIG)")
    nodes.add_argument("--json", action="store_true", help="print JSON instead of a table")
    nodes.set_defaults(func=admin_nodes)


def admin_nodes(args: argparse.Namespace) -> int:
    cfg = _load(args, {})
    if cfg is None:
        return 2
    if not cfg.cluster.enabled:
        print("kvpool: no cluster configured (set cluster.etcd or cluster.nodes)",
              file=sys.stderr)
        return 2
    from kvpool.net.client import ClusterClient
    try:
        client = ClusterClient(cfg.cluster)
    except KVPoolError as exc:
        print(f"kvpool: {exc}", file=sys.stderr)
        return 1
    try:
        nodes = {n.node_id: n.address() for n in client.membership.live_nodes()}
        stats = client.node_stats()
    finally:
        client.close()
    rows = []
    for node_id, address in nodes.items():
        st = stats.get(node_id)
        dram, ssd = (st or {}).get("dram", {}), (st or {}).get("ssd", {})
        rows.append({"node_id": node_id, "address": address, "up": st is not None,
                     "dram_entries": dram.get("entries"), "dram_used": dram.get("used_bytes"),
                     "ssd_records": ssd.get("records"), "ssd_used": ssd.get("used_bytes"),
                     "uptime_s": (st or {}).get("server", {}).get("uptime_s")})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table
    table = Table(title=f"kvpool cluster {cfg.cluster.name!r}: {len(rows)} nodes")
    for col in ("node", "address", "up", "DRAM chunks", "DRAM MiB", "SSD chunks", "SSD MiB",
                "uptime s"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["node_id"], r["address"], "yes" if r["up"] else "NO",
                      *(str(r[k]) if r[k] is not None else "-" for k in ("dram_entries",)),
                      _mib(r["dram_used"]), str(r["ssd_records"] or "-"), _mib(r["ssd_used"]),
                      str(r["uptime_s"] or "-"))
    Console().print(table)
    return 0


def _mib(value: Any) -> str:
    return f"{value / 2**20:.1f}" if isinstance(value, int) else "-"
