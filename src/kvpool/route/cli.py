"""``kvpool route``: options, and the run behind them (docs/routing.md)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import NamedTuple

from kvpool.route.policy import (
    DEFAULT_LOAD_TOKENS,
    DEFAULT_OVERLOAD,
    POLICY_NAMES,
    TierWeights,
    make_policy,
)


def parse_engine(spec: str) -> EngineFields:
    """``URL[,events=EP[,replay=EP]][,host=EP[,host-replay=EP]]...`` -> the EngineSpec's
    fields (``replay``: the vLLM publisher's replay socket; ``host-replay``: that of the
    ``host=`` before it). Raises ValueError for an unknown or misplaced field or a URL that is
    not http(s)."""
    url, *fields = spec.split(",")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--engine {spec!r}: the first field must be an http(s) URL")
    events: str | None = None
    replay: str | None = None
    hosts: list[str] = []
    host_replays: list[str | None] = []
    for f in fields:
        name, _, value = f.partition("=")
        if name == "events" and value:
            events = value
        elif name == "replay" and value:
            replay = value
        elif name == "host" and value:
            hosts.append(value)
            host_replays.append(None)
        elif name == "host-replay" and value and hosts and host_replays[-1] is None:
            host_replays[-1] = value
        else:
            raise ValueError(f"--engine {spec!r}: unknown or misplaced field {f!r} (events=, "
                             "replay=, host=, host-replay= after its host=)")
    return EngineFields(url, events, tuple(hosts), replay, tuple(host_replays))


def parse_storage(spec: str) -> tuple[str, str | None]:
    """``EP[,replay=EP]`` -> (publisher, replay socket or None). Raises ValueError."""
    endpoint, *fields = spec.split(",")
    replay: str | None = None
    for f in fields:
        name, _, value = f.partition("=")
        if name != "replay" or not value:
            raise ValueError(f"--storage-events {spec!r}: unknown field {f!r} (replay=)")
        replay = value
    return endpoint, replay


class EngineFields(NamedTuple):
    url: str
    events: str | None
    host_events: tuple[str, ...]
    replay: str | None
    host_replays: tuple[str | None, ...]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    w = TierWeights()
    parser.add_argument("--engine", action="append", required=True,
                        metavar="URL[,events=EP[,replay=EP]][,host=EP[,host-replay=EP]]",
                        help="an engine's OpenAI server, its vLLM KV-event publisher (ZMQ) "
                             "and its host pools' kvpool publishers, each optionally with "
                             "its replay socket (a gap is then replayed, not reset); repeat "
                             "per engine")
    parser.add_argument("--storage-events", metavar="EP[,replay=EP]", action="append",
                        default=[],
                        help="a storage node's kvpool KV-event publisher and optionally its "
                             "replay socket (repeat)")
    parser.add_argument("--namespace-id", metavar="HEX", default=None,
                        help="kvpool namespace id (32 hex chars) of the model's chunks in the "
                             "pool; without it the pool tiers are not scored")
    parser.add_argument("--chunk-tokens", metavar="N", type=int, default=256,
                        help="tokens per kvpool chunk of that namespace (default %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="listen address")
    parser.add_argument("--port", type=int, default=8000, help="listen port (default 8000)")
    parser.add_argument("--policy", choices=POLICY_NAMES, default="kv",
                        help="routing policy (default %(default)s)")
    parser.add_argument("--tier-weights", metavar=("ENGINE", "HOST", "STORAGE"), nargs=3,
                        type=float, default=[w.engine, w.host, w.storage],
                        help="credit per cached token by tier (default "
                             f"{w.engine} {w.host} {w.storage})")
    parser.add_argument("--load-tokens", type=float, default=DEFAULT_LOAD_TOKENS,
                        help="cached tokens one request in flight outweighs (default "
                             "%(default)s)")
    parser.add_argument("--prefill-weight", type=float, default=1.0,
                        help="weight of an engine's queued prefill tokens (default "
                             "%(default)s)")
    parser.add_argument("--overload-factor", type=float, default=DEFAULT_OVERLOAD,
                        help="an engine above X x the mean in flight (+1) is left out "
                             "(default %(default)s)")
    parser.add_argument("--index-timeout", type=float, default=0.5, metavar="SECONDS",
                        help="tokenize + score within this, else least-loaded (default "
                             "%(default)s)")
    parser.add_argument("--engine-metrics-interval", type=float, default=1.0,
                        metavar="SECONDS",
                        help="read each engine's /metrics (vLLM's running + waiting "
                             "requests) this often for its load; 0: only the proxy's own "
                             "counts (default %(default)s)")
    parser.add_argument("--dead-cooldown", type=float, default=5.0, metavar="SECONDS",
                        help="an unreachable engine is skipped this long (default "
                             "%(default)s)")


def run_from_args(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM: 0; 2 for a bad option or a port that cannot be bound;
    1 if aiohttp/pyzmq/msgspec are missing (the ``router`` extra)."""
    try:
        from kvpool.route.proxy import EngineSpec, Router, RouterSettings
    except ImportError as exc:
        print(f"kvpool route: {exc}; install kvpool[router]", file=sys.stderr)
        return 1
    try:
        engines = [EngineSpec(*parse_engine(s)) for s in args.engine]
        storage = [parse_storage(s) for s in args.storage_events]
        ns = bytes.fromhex(args.namespace_id) if args.namespace_id else None
        if ns is not None and len(ns) != 16:
            raise ValueError("--namespace-id must be 32 hex characters")
        if args.chunk_tokens < 1 or args.index_timeout <= 0 or args.dead_cooldown < 0 \
                or not args.engine_metrics_interval >= 0:
            raise ValueError("--chunk-tokens, --index-timeout must be > 0, --dead-cooldown "
                             "and --engine-metrics-interval >= 0")
        policy = make_policy(args.policy, TierWeights(*args.tier_weights), args.load_tokens,
                             args.overload_factor, args.prefill_weight)
        settings = RouterSettings(engines, policy, tuple(ep for ep, _ in storage), ns,
                                  args.chunk_tokens, args.index_timeout, args.dead_cooldown,
                                  storage_replays=tuple(r for _, r in storage),
                                  engine_metrics_interval_s=args.engine_metrics_interval)
        router = Router(settings)
    except ValueError as exc:
        print(f"kvpool route: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    async def serve() -> int:
        try:
            port = await router.start(args.host, args.port)
        except OSError as exc:
            print(f"kvpool route: {exc}", file=sys.stderr)
            await router.close()
            return 2
        logging.info("kvpool route on http://%s:%d, %d engines, policy %s", args.host, port,
                     len(engines), args.policy)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await router.close()
        return 0

    return asyncio.run(serve())
