"""``kvpool serve``: the storage node's command-line entry point (``kvpool admin`` is in
kvpool/admin/)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from kvpool.config import Config, load_config
from kvpool.errors import ConfigError
from kvpool.logs import say


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file (default: $KVPOOL_CONFIG); sections "
                        "server, cluster, dram, ssd, pool")
    parser.add_argument("--host", help="override server.host")
    parser.add_argument("--port", type=int, help="override server.port (0 = any free port)")
    parser.add_argument("--node-id", help="override server.node_id")
    parser.add_argument("--cache-dir", help="override cache_dir (where the SSD tier lives)")


def load_or_exit(args: argparse.Namespace, overrides: dict[str, Any],
                 prog: str = "kvpool") -> Config | None:
    """The config of ``--config`` with ``overrides``; None (the error printed as one line on
    stderr: exit 2) for a bad one."""
    try:
        return load_config(args.config, overrides=overrides)
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None


T = TypeVar("T")


def start_or_exit(cfg: Config, prog: str, start: Callable[[], T],
                  setting_error: type[Exception]) -> tuple[T, None] | tuple[None, int]:
    """``(start(), None)``, or ``(None, exit code)`` with the failure logged as one line
    (``start_failed``): 2 for ``setting_error`` (a setting that must change), 1 for an
    OSError (the OS refused: a port or socket taken). ``kvpool serve`` and ``kvpool host``
    start this way."""
    try:
        return start(), None
    except setting_error as exc:
        say(cfg.log, logging.ERROR, f"{prog}: {exc}", "start_failed")
        return None, 2
    except OSError as exc:
        say(cfg.log, logging.ERROR, f"{prog}: cannot start: {exc}", "start_failed")
        return None, 1


def serve_from_args(args: argparse.Namespace) -> int:
    """``kvpool serve``. Exit 2 with one line on stderr for a setting that must change (bad
    config, tier geometry the media cannot hold, unreachable etcd, a node id another node
    holds), and 2 when another node took the node id while running; 1 for an OS failure at
    start (e.g. the port is taken); 0 after a clean stop (SIGTERM, SIGINT, also during
    start-up). SIGHUP reloads the config (node.py)."""
    server = {k: v for k, v in (("host", args.host), ("port", args.port),
                                ("node_id", args.node_id)) if v is not None}
    overrides: dict[str, Any] = {"server": server} if server else {}
    if args.cache_dir:
        overrides["cache_dir"] = args.cache_dir
    cfg = load_or_exit(args, overrides, "kvpool serve")
    if cfg is None:
        return 2
    from kvpool.server.node import NodeStartError, run

    def reload_config() -> Config:  # SIGHUP: the same file, environment and flags again
        return load_config(args.config, overrides=overrides)

    code, failed = start_or_exit(cfg, "kvpool serve", lambda: run(cfg, reload_config),
                                 NodeStartError)
    return failed if failed is not None else (code or 0)
