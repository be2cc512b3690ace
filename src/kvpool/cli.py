"""``kvpool`` command line: demo, plan, serve, host, monitor, admin, bench, config."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvpool import __version__


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvpool {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    config = sub.add_parser("config", help="print the effective settings (YAML; tokens "
                            "shown as ***) or their docs")
    config.add_argument("--config", help="YAML file (default: $KVPOOL_CONFIG)")
    config.add_argument("--doc", action="store_true", help="print every knob as Markdown")
    config.set_defaults(func=_config_command)
    demo = sub.add_parser("demo", help="prefix reuse with a real model: TTFT in every mode")
    from kvpool.demo import cli as demo_cli
    demo_cli.add_arguments(demo)
    demo.set_defaults(func=demo_cli.run_from_args)
    from kvpool.plan import cli as plan_cli
    plan = sub.add_parser("plan", help="replay a whole request trace offline: hit rate, TTFT "
                          "and cost per tier size and policy, beside Belady")
    plan_cli.add_arguments(plan)
    plan.set_defaults(func=plan_cli.run_from_args)
    route = sub.add_parser("route", help="KV-aware OpenAI proxy in front of N engines: each "
                           "request to the engine holding most of its prefix")
    from kvpool.route import cli as route_cli
    route_cli.add_arguments(route)
    route.set_defaults(func=route_cli.run_from_args)
    from kvpool.server import cli as server_cli
    serve = sub.add_parser("serve", help="run a storage node (DRAM + SSD over the network)")
    server_cli.add_serve_arguments(serve)
    serve.set_defaults(func=server_cli.serve_from_args)
    from kvpool.host import cli as host_cli
    host = sub.add_parser("host", help="run the host pool that the host's engine processes "
                          "attach to (host.socket)")
    host_cli.add_arguments(host)
    host.set_defaults(func=host_cli.run_from_args)
    monitor = sub.add_parser("monitor", help="live view of /metrics endpoints: hit rate, "
                             "bandwidth, latency per tier")
    from kvpool.monitor import cli as monitor_cli
    monitor_cli.add_arguments(monitor)
    monitor.set_defaults(func=monitor_cli.run_from_args)
    admin = sub.add_parser("admin", help="cluster and media administration: nodes, stats, "
                           "invalidate, drain, undrain, verify")
    from kvpool.admin import cli as admin_cli
    admin_cli.add_admin_arguments(admin)
    bench = sub.add_parser("bench", help="benchmarks beside their references")
    bench_sub = bench.add_subparsers(dest="suite", required=True)
    storage = bench_sub.add_parser("storage", help="DRAM arena and SSD engine vs memcpy, "
                                   "raw O_DIRECT and a file-per-chunk store")
    from kvpool.bench import storage as storage_bench
    storage_bench.add_arguments(storage)
    storage.set_defaults(func=storage_bench.run_from_args)
    remote = bench_sub.add_parser("remote", help="one storage node on loopback vs a raw "
                                  "socket and Redis")
    from kvpool.bench import remote as remote_bench
    remote_bench.add_arguments(remote)
    remote.set_defaults(func=remote_bench.run_from_args)
    vllm_p = bench_sub.add_parser("vllm", help="TTFT of a vLLM CPU engine: recompute vs "
                                  "kvpool hits vs vLLM's ExampleConnector")
    from kvpool.bench import vllm as vllm_bench
    vllm_bench.add_arguments(vllm_p)
    vllm_p.set_defaults(func=vllm_bench.run_from_args)
    sglang_p = bench_sub.add_parser("sglang", help="SGLang HiCache L3: kvpool's v1 page calls "
                                    "vs SGLang's bundled file backend on SGLang's host pool")
    from kvpool.bench import sglang as sglang_bench
    sglang_bench.add_arguments(sglang_p)
    sglang_p.set_defaults(func=sglang_bench.run_from_args)
    serve_p = bench_sub.add_parser("serve", help="vLLM's OpenAI server under vllm bench serve: "
                                   "kvpool hits after a restart vs the engine's prefix cache")
    from kvpool.bench import serve as serve_bench
    serve_bench.add_arguments(serve_p)
    serve_p.set_defaults(func=serve_bench.run_from_args)
    host_p = bench_sub.add_parser("host", help="an engine attached to the host pool vs an "
                                  "in-process DRAM tier and a loopback storage node")
    from kvpool.bench import host as host_bench
    host_bench.add_arguments(host_p)
    host_p.set_defaults(func=host_bench.run_from_args)
    route_p = bench_sub.add_parser("route", help="two vLLM CPU servers behind kvpool route: "
                                   "KV-aware routing vs round robin TTFT")
    from kvpool.bench import route as route_bench
    route_bench.add_arguments(route_p)
    route_p.set_defaults(func=route_bench.run_from_args)
    trace_p = bench_sub.add_parser("trace", help="kvpool plan: a whole trace replayed "
                                   "through kvpool's policies, beside Belady")
    plan_cli.add_arguments(trace_p)
    trace_p.set_defaults(func=plan_cli.run_from_args)
    return parser


def _config_command(args: argparse.Namespace) -> int:
    if args.doc:
        from kvpool.configdoc import config_markdown
        print(config_markdown(), end="")
        return 0
    import yaml

    from kvpool.config import load_config, redact_secrets
    from kvpool.errors import ConfigError
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"kvpool: {exc}", file=sys.stderr)
        return 2
    if cfg.dram.warm_cache_ratio is not None:
        print(f"# dram.capacity resolved from dram.warm_cache_ratio={cfg.dram.warm_cache_ratio}"
              " of this host's memory; a file may set one of the two, not both")
    # Tokens are secrets: printed as *** (a config is pasted into tickets and chats).
    print(yaml.safe_dump(redact_secrets(cfg.model_dump()), sort_keys=False), end="")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
