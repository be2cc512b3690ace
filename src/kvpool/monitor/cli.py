"""``kvpool monitor [--endpoint URL ...] [--interval S] [--once] [--json]``.

Scrapes every endpoint's ``/metrics`` each interval and shows, per endpoint and tier, what
happened between the last two scrapes (:mod:`kvpool.monitor.report`). Without ``--endpoint``
the endpoints are the cluster's nodes from the config: each node registered in etcd
(``cluster.etcd``) with the ``metrics_port`` it registered; or each static node
(``cluster.nodes``) at ``server.metrics_port``. A node in etcd's expected set that is not
registered is a ``MISSING`` row. They are found once, at start: a node that stops shows as
down, one that joins later is not added.

Exit status: 0 (``--once`` with at least one endpoint up and no expected node missing, or the
live view left with Ctrl-C); 1 if every endpoint was down or an expected node is missing
(``--once``) or etcd could not be read; 2 for bad arguments or no endpoint to watch. A down
endpoint is a row of the view, never a crash.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvpool.monitor.report import endpoint_report
from kvpool.monitor.scrape import Scrape, endpoint_url, scrape_all
from kvpool.monitor.view import render

__all__ = ["Target", "add_arguments", "run_from_args"]

_WIDE = 120  # columns the tables need to show every figure unabridged


@dataclass(frozen=True)
class Target:
    """One endpoint to watch: the name it is shown under and its URL, or (``url`` None) why
    it cannot be scraped (a node registered without a metrics port); such a target is always
    down."""

    name: str
    url: str | None
    problem: str | None = None
    #: In the expected set but not registered (kvpool.cluster.states MISSING).
    missing: bool = False


class _SetupError(Exception):
    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", action="append", default=[], metavar="URL",
                        help="a /metrics endpoint (host:port means http://host:port/metrics); "
                        "repeat for more. Default: the cluster's nodes from the config")
    parser.add_argument("--interval", type=float, default=2.0, metavar="S",
                        help="seconds between scrapes: rates and quantiles are over this "
                        "interval (default 2; each scrape waits at most min(S, 5) s, at "
                        "least 1 s)")
    parser.add_argument("--once", action="store_true",
                        help="take two scrapes --interval apart, print one snapshot, exit")
    parser.add_argument("--json", action="store_true",
                        help="with --once: print one JSON document instead of tables")
    parser.add_argument("--config", help="YAML file for the default endpoints "
                        "(default: $KVPOOL_CONFIG)")


def run_from_args(args: argparse.Namespace) -> int:
    if not args.interval > 0 or not math.isfinite(args.interval):
        print("kvpool monitor: --interval must be a positive number of seconds",
              file=sys.stderr)
        return 2
    if args.json and not args.once:
        print("kvpool monitor: --json needs --once", file=sys.stderr)
        return 2
    try:
        targets = _targets(args.endpoint, args.config)
    except _SetupError as exc:
        print(f"kvpool monitor: {exc}", file=sys.stderr)
        return exc.status
    timeout_s = max(1.0, min(args.interval, 5.0))
    if args.once:
        return _once(targets, args.interval, timeout_s, args.json)
    return _live(targets, args.interval, timeout_s)


def _targets(endpoints: Sequence[str], config: str | None) -> list[Target]:
    if endpoints:
        try:
            return [Target(e, endpoint_url(e)) for e in endpoints]
        except ValueError as exc:
            raise _SetupError(str(exc), 2) from exc
    from kvpool.config import load_config
    from kvpool.errors import ConfigError
    try:
        cfg = load_config(config)
    except ConfigError as exc:
        raise _SetupError(str(exc), 2) from exc
    if cfg.cluster.etcd:
        return _etcd_targets(cfg.cluster.etcd, cfg.cluster.name)
    if cfg.cluster.nodes and cfg.server.metrics_port:  # static nodes sharing one config
        from kvpool.cluster.membership import NodeInfo
        try:
            nodes = [NodeInfo.from_address(a) for a in cfg.cluster.nodes]
        except ValueError as exc:
            raise _SetupError(str(exc), 2) from exc
        return [Target(n.node_id, replace(n, metrics_port=cfg.server.metrics_port).metrics_url())
                for n in nodes]
    raise _SetupError("no endpoint: give --endpoint, or a config with cluster.etcd (nodes "
                      "registered with server.metrics_port) or cluster.nodes and "
                      "server.metrics_port", 2)


def _etcd_targets(etcd: Sequence[str], cluster: str) -> list[Target]:
    """Every node registered in ``cluster``, at the metrics port its record names."""
    from kvpool.cluster.etcd import EtcdError
    from kvpool.cluster.etcd_membership import read_cluster
    try:
        read = read_cluster(etcd, cluster)
    except (EtcdError, ValueError) as exc:
        raise _SetupError(f"cannot list the nodes in etcd: {exc}", 1) from exc
    if not read.nodes and not read.expected:
        raise _SetupError(f"no node is registered in cluster {cluster!r}", 2)
    registered = {n.node_id for n in read.nodes}
    targets = [Target(n.node_id, n.metrics_url(),
                      None if n.metrics_port else "registered without a metrics port (set "
                      "server.metrics_port on the node)") for n in read.nodes]
    targets += [Target(node_id, None, "expected but not registered (last at "
                       f"{address or '?'}; `kvpool admin forget {node_id}` if gone for good)",
                       missing=True)
                for node_id, address in read.expected.items() if node_id not in registered]
    return sorted(targets, key=lambda t: t.name)


def _scrape(targets: Sequence[Target], timeout_s: float) -> list[Scrape]:
    urls = [t.url for t in targets if t.url is not None]
    found = iter(scrape_all(urls, timeout_s))
    now = time.monotonic()
    return [next(found) if t.url is not None else Scrape("", now, error=t.problem)
            for t in targets]


def _reports(targets: Sequence[Target], before: Sequence[Scrape],
             after: Sequence[Scrape]) -> dict[str, dict[str, Any]]:
    reports = {t.name: endpoint_report(b, a) for t, b, a in zip(targets, before, after,
                                                                strict=True)}
    for t in targets:
        if t.missing:
            reports[t.name]["missing"] = True
    return reports


def _title(targets: Sequence[Target], interval: float) -> str:
    return f"kvpool monitor: {len(targets)} endpoint(s), figures over {interval:g} s"


def _once(targets: Sequence[Target], interval: float, timeout_s: float, as_json: bool) -> int:
    started = time.monotonic()
    before = _scrape(targets, timeout_s)
    time.sleep(max(0.0, interval - (time.monotonic() - started)))
    reports = _reports(targets, before, _scrape(targets, timeout_s))
    if as_json:
        print(json.dumps(_finite(reports), indent=2))
    else:
        from rich.console import Console
        console = Console()
        if not console.is_terminal:  # a pipe or file: the whole table, not 80 columns of it
            console.width = max(console.width, _WIDE)
        console.print(render(reports, _title(targets, interval)))
    if any(t.missing for t in targets):
        return 1
    return 0 if any(r["up"] for r in reports.values()) else 1


def _live(targets: Sequence[Target], interval: float, timeout_s: float) -> int:
    from rich.console import Console
    from rich.live import Live
    try:
        with Live(console=Console(), auto_refresh=False) as live:
            started = time.monotonic()
            before = _scrape(targets, timeout_s)
            live.update(render(_reports(targets, before, before),
                               _title(targets, interval)), refresh=True)
            while True:
                time.sleep(max(0.0, interval - (time.monotonic() - started)))
                started = time.monotonic()
                after = _scrape(targets, timeout_s)
                live.update(render(_reports(targets, before, after),
                                   _title(targets, interval)), refresh=True)
                before = after
    except KeyboardInterrupt:
        return 0


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities (a gauge may expose them) as None: strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value
