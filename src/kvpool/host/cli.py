"""``kvpool host``: run the host pool (one per host) that engine processes attach to.

Why a command of its own beside ``kvpool serve``: a storage node keeps every tenant in one
pool (keys scoped per tenant, its arena never leaves the process), while the host pool hands
its arena's memory to other processes, so it keeps one pool and one arena per tenant; and it
serves a Unix socket, not TCP. Its tiers below DRAM are its own SSD and, with a cluster
configured, the storage nodes as their client, like an embedded pool's.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

from prometheus_client.registry import CollectorRegistry

from kvpool.config import Config
from kvpool.logs import STATUS_LOGGER, configure_logging, say
from kvpool.server.cli import load_or_exit, start_or_exit

if TYPE_CHECKING:
    from kvpool.host.server import HostServer
    from kvpool.metrics.http import MetricsServer
    from kvpool.server.query import QueryService

status = logging.getLogger(STATUS_LOGGER)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file (default: $KVPOOL_CONFIG); sections host, "
                        "dram, ssd, pool, cluster, server.auth")
    parser.add_argument("--socket", help="override host.socket (the Unix socket engines "
                        "attach to)")
    parser.add_argument("--cache-dir", help="override cache_dir (where the SSD tier lives)")
    parser.epilog = ("With server.metrics_port set, /healthz, /readyz, /metrics, /events, "
                     "/query and /query_by_hash are served on it (server.host). KV events are "
                     "published unless events.enabled is false (docs/routing.md).")


def run_from_args(args: argparse.Namespace) -> int:
    """Exit 2 with one line on stderr for a setting to fix (bad config, no DRAM, the socket
    held by a live host pool, an events port that cannot be bound: it names events.port and
    events.replay_port); 1 when the socket or server.metrics_port cannot be bound; 0 after
    SIGTERM/SIGINT, once every tenant's pool is closed (write-behind drained to SSD)."""
    overrides: dict[str, Any] = {}
    if args.socket:
        overrides["host"] = {"socket": args.socket}
    if args.cache_dir:
        overrides["cache_dir"] = args.cache_dir
    cfg = load_or_exit(args, overrides, "kvpool host")
    if cfg is None:
        return 2
    from kvpool.host.server import HostServer, HostStartError
    server, failed = start_or_exit(cfg, "kvpool host", lambda: HostServer(cfg), HostStartError)
    if server is None:
        return failed or 1
    configure_logging(cfg.log)
    try:
        pages = _serve_pages(cfg, server)
    except OSError as exc:
        server.stop()
        say(cfg.log, logging.ERROR, f"kvpool host: cannot serve server.metrics_port: {exc}",
            "start_failed")
        return 1
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.start()
    status.info("host pool listening on %s", server.path, extra={"event": "listening"})
    while not stop.wait(1.0):
        pass
    server.stop()
    if pages is not None:
        pages[0].close()
        pages[1].close()
    status.info("host pool stopped", extra={"event": "stopped"})
    return 0


def _serve_pages(cfg: Config, server: HostServer) -> tuple[MetricsServer, QueryService] | None:
    """``/healthz``, ``/readyz``, ``/metrics`` (the probes of a DaemonSet), ``/events`` and
    the query API (host/events.py) on ``server.metrics_port`` (unset: none). ``/metrics`` is
    the tenant's pool's with one tenant (no ``server.auth``); with several, only the host
    pool's health and its events' figures (the pools' figures would share names). Raises
    OSError when the port cannot be bound."""
    port = cfg.server.metrics_port
    if port is None:
        return None
    from kvpool.events.attach import EventsCollector
    from kvpool.host.events import host_query
    from kvpool.metrics.http import MetricsServer as Pages
    from kvpool.server.health import events_page, health_pages
    pools = server.tenants.pools()
    registry = pools[0].pool.metrics if len(pools) == 1 else CollectorRegistry()
    registry.register(EventsCollector(server.events))
    handlers = health_pages(server.readiness, list, cfg.cluster.name)
    pages = {k: v for k, v in handlers.items() if k in ("/healthz", "/readyz")}
    pages.update(events_page(server.events))
    query = host_query(cfg, server.tenants, server.events)
    try:
        return Pages(registry, cfg.server.host, port, pages, query.handlers()), query
    except BaseException:
        query.close()
        raise
