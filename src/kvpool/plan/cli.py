"""``kvpool plan`` (also ``kvpool bench trace``): options, and the run behind them."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvpool.config import parse_size
from kvpool.plan import cost
from kvpool.plan.planner import PlanSettings, plan
from kvpool.plan.trace import SOURCE_BLOCK, Trace, read_trace
from kvpool.policy import ADMISSION_POLICIES, EVICTION_NAMES, EVICTION_POLICIES, SEGMENT_POLICIES

if TYPE_CHECKING:
    from rich.console import Console

DEFAULT_DRAM = ("5%", "10%", "25%", "50%", "100%")
DEFAULT_SSD = ("0", "100%")

_COST_FLAGS = {  # CostModel field -> help
    "prefill_s_per_token": "prefill seconds per prompt token",
    "lookup_s": "seconds per lookup",
    "dram_read_gbps": "DRAM read bandwidth, GB/s",
    "dram_latency_s": "DRAM read latency, seconds",
    "ssd_read_gbps": "SSD read bandwidth, GB/s",
    "ssd_latency_s": "SSD read latency, seconds",
    "engine_hour_usd": "price of one engine-hour, USD (also --gpu-hour-usd)",
    "dram_gib_month_usd": "DRAM price per GiB-month, USD",
    "ssd_gib_month_usd": "SSD price per GiB-month, USD",
    "decode_s_per_token": "decode seconds per output token (with --engines)",
}


def _escaped(sizes: tuple[str, ...]) -> str:
    """Sizes for an argparse help text, whose '%' must be doubled."""
    return " ".join(sizes).replace("%", "%%")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = PlanSettings(0, None, (), (), ())
    parser.add_argument("--trace", metavar="FILE", type=Path, required=True,
                        help="request trace (JSON lines, the format of shared/traces)")
    parser.add_argument("--requests", metavar="N", type=int, default=None,
                        help="replay only the first N requests")
    parser.add_argument("--block-tokens", metavar="N", type=int, default=SOURCE_BLOCK,
                        help=f"tokens per chunk; must divide the trace's {SOURCE_BLOCK}-token "
                             f"blocks (default {SOURCE_BLOCK})")
    parser.add_argument("--store-partial", action="store_true",
                        help="store a request's partial last chunk too (as an engine that "
                             "saves unfull chunks); by default it is never stored, always "
                             "prefilled")
    parser.add_argument("--preset", choices=sorted(cost.PRESETS), default=cost.DEFAULT_PRESET,
                        help="engine the cost model describes: "
                             + "; ".join(f"{k}: {v.description}"
                                         for k, v in sorted(cost.PRESETS.items()))
                             + " (default %(default)s); the flags below override it")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--bytes-per-token", metavar="N", type=int, default=None,
                      help="KV bytes per token (instead of --model)")
    size.add_argument("--model", metavar="NAME", choices=sorted(cost.MODELS), default=None,
                      help=f"bytes per token of a known model: {', '.join(sorted(cost.MODELS))} "
                           "(default: the --preset's)")
    parser.add_argument("--dram", metavar="SIZE", nargs="+", default=list(DEFAULT_DRAM),
                        help="DRAM sizes: bytes (4GiB) or %% of the trace's distinct chunks "
                             f"(default {_escaped(DEFAULT_DRAM)})")
    parser.add_argument("--ssd", metavar="SIZE", nargs="+", default=list(DEFAULT_SSD),
                        help="SSD sizes, as --dram; 0 = no SSD (default "
                             f"{_escaped(DEFAULT_SSD)})")
    parser.add_argument("--policy", metavar="NAME", nargs="+", choices=EVICTION_NAMES,
                        default=sorted(EVICTION_POLICIES),
                        help=f"DRAM eviction policies (default all: "
                             f"{', '.join(sorted(EVICTION_POLICIES))})")
    parser.add_argument("--ssd-policy", choices=sorted(SEGMENT_POLICIES),
                        default=defaults.ssd_policy, help="ssd.eviction (default %(default)s)")
    parser.add_argument("--ssd-segment", metavar="SIZE", default=None,
                        help=f"ssd.segment_size (default {defaults.segment_size} bytes; "
                             "2GiB with --preset gpu-70b, whose chunks are 160 MiB)")
    parser.add_argument("--copy-forward-fraction", type=float,
                        default=defaults.copy_forward_fraction,
                        help="ssd.copy_forward_fraction (default %(default)s)")
    parser.add_argument("--ssd-write", choices=("through", "evict"), default=defaults.ssd_write,
                        help="pool.ssd_write (default %(default)s)")
    parser.add_argument("--admission", choices=ADMISSION_POLICIES,
                        default=defaults.admission,
                        help="ssd.admission, with --ssd-write evict (default %(default)s)")
    parser.add_argument("--storage-json", metavar="PATH", type=Path, default=None,
                        help="read DRAM and SSD read bandwidth from kvpool bench storage --json")
    for name, text in _COST_FLAGS.items():
        flags = ["--" + name.replace("_", "-")]
        if name == "engine_hour_usd":
            flags.append("--gpu-hour-usd")  # its name before engines were not only GPUs
        parser.add_argument(*flags, dest=name, type=float, default=None,
                            help=f"{text} (default: the --preset's, cpu "
                                 f"{getattr(defaults.costs, name):g})")
    parser.add_argument("--ttft-p99", metavar="SECONDS", type=float, default=None,
                        help="report the cheapest configuration whose TTFT p99 is at most this")
    parser.add_argument("--json", metavar="PATH", type=Path, default=None,
                        help="also write the results as JSON to PATH")
    parser.add_argument("--plot", metavar="DIR", type=Path, default=None,
                        help="write PNG charts into DIR (needs matplotlib: the hf extra)")
    _add_routing_arguments(parser)


def _add_routing_arguments(parser: argparse.ArgumentParser) -> None:
    from kvpool.plan import routing
    from kvpool.route.policy import (
        DEFAULT_LOAD_TOKENS,
        DEFAULT_OVERLOAD,
        POLICY_NAMES,
        TierWeights,
    )
    w = TierWeights()
    group = parser.add_argument_group(
        "routing", "with --engines: replay the trace across N engines under each routing "
        "policy instead of the tier-size grid (docs/routing.md)")
    group.add_argument("--engines", metavar="N", type=int, default=None,
                       help="engines, each with its own engine cache and host pool, over one "
                            "shared storage tier")
    group.add_argument("--routing", metavar="NAME", nargs="+", choices=POLICY_NAMES,
                       default=list(routing.DEFAULT_ROUTING),
                       help=f"policies to compare (default {' '.join(routing.DEFAULT_ROUTING)})")
    group.add_argument("--engine-cache", metavar="SIZE", default=routing.DEFAULT_ENGINE_CACHE,
                       help="each engine's own prefix cache: bytes or %% of the trace's "
                            "distinct chunks (default "
                            f"{_escaped((routing.DEFAULT_ENGINE_CACHE,))})")
    group.add_argument("--host-pool", metavar="SIZE", default=routing.DEFAULT_HOST_POOL,
                       help="each engine's kvpool host pool, as --engine-cache (default "
                            f"{_escaped((routing.DEFAULT_HOST_POOL,))})")
    group.add_argument("--storage", metavar="SIZE", default=routing.DEFAULT_STORAGE,
                       help="the shared storage tier, as --engine-cache (default "
                            f"{_escaped((routing.DEFAULT_STORAGE,))})")
    group.add_argument("--tier-weights", metavar=("ENGINE", "HOST", "STORAGE"), nargs=3,
                       type=float, default=[w.engine, w.host, w.storage],
                       help="credit per cached token by tier (default "
                            f"{w.engine} {w.host} {w.storage})")
    group.add_argument("--load-tokens", metavar="TOKENS", type=float,
                       default=DEFAULT_LOAD_TOKENS,
                       help="kv policy: cached tokens one request in flight outweighs "
                            "(default %(default)s)")
    group.add_argument("--prefill-weight", metavar="X", type=float, default=1.0,
                       help="kv policy: weight of the prompt tokens queued for prefill on an "
                            "engine (default %(default)s)")
    group.add_argument("--overload-factor", metavar="X", type=float, default=DEFAULT_OVERLOAD,
                       help="kv policy: an engine above X x the mean load (+1) is left out "
                            "(default %(default)s)")


def settings_from_args(args: argparse.Namespace) -> PlanSettings:
    """Raises ValueError for a bad size or option (a negative, infinite or NaN figure
    included), OSError for an unreadable --storage-json."""
    preset = cost.PRESETS[args.preset]
    if args.bytes_per_token is not None:
        if args.bytes_per_token < 1:
            raise ValueError(f"--bytes-per-token must be >= 1, got {args.bytes_per_token}")
        bpt, model = args.bytes_per_token, None
    else:
        model = args.model or preset.model
        bpt = cost.model_bytes_per_token(model)
    costs = replace(cost.CostModel(), **preset.figures)
    sources = {**cost.SOURCES, **preset.sources}
    if args.storage_json is not None:
        costs = costs.with_storage_json(args.storage_json)
        for k in ("dram_read_gbps", "ssd_read_gbps"):
            sources[k] = f"read from {args.storage_json} (kvpool bench storage --json)"
    given = {f.name: getattr(args, f.name) for f in fields(costs)
             if getattr(args, f.name, None) is not None}
    bad = [k for k, v in given.items()
           if not math.isfinite(v) or v < 0 or (k.endswith("gbps") and v == 0)]
    if bad:
        raise ValueError(f"--{bad[0].replace('_', '-')} must be a finite number >= 0 "
                         f"(> 0 for a bandwidth), got {given[bad[0]]}")
    sources.update({k: f"given: --{k.replace('_', '-')}" for k in given})
    if args.ttft_p99 is not None and not (math.isfinite(args.ttft_p99) and args.ttft_p99 > 0):
        raise ValueError(f"--ttft-p99 must be a finite number of seconds > 0, got "
                         f"{args.ttft_p99}")
    if not 0 <= args.copy_forward_fraction <= 0.9:
        raise ValueError("--copy-forward-fraction must be in [0, 0.9]")
    return PlanSettings(bytes_per_token=bpt, model=model, dram=args.dram, ssd=args.ssd,
                        policies=args.policy, ssd_policy=args.ssd_policy,
                        segment_size=parse_size(args.ssd_segment) if args.ssd_segment
                        else preset.segment_size or PlanSettings.segment_size,
                        copy_forward_fraction=args.copy_forward_fraction,
                        ssd_write=args.ssd_write, admission=args.admission,
                        ttft_p99_s=args.ttft_p99, costs=replace(costs, **given),
                        preset=args.preset, cost_sources=sources)


def run_from_args(args: argparse.Namespace) -> int:
    """0 on success; 2 (with the reason on stderr) for a bad trace, option or file."""
    from rich.console import Console

    from kvpool.plan.report import print_report, write_json
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # tables stay readable when piped or logged
    try:
        settings = settings_from_args(args)
        trace = read_trace(args.trace, args.block_tokens, store_partial=args.store_partial)
        if args.requests is not None:
            if args.requests < 1:
                raise ValueError(f"--requests must be >= 1, got {args.requests}")
            trace = trace.head(args.requests)
        if args.engines is not None:
            return _run_routing(args, settings, trace, console)
        result = plan(trace, settings)
    except (ValueError, OSError) as exc:
        print(f"kvpool plan: {exc}", file=sys.stderr)
        return 2
    print_report(result, console)
    try:
        if args.json is not None:
            write_json(result, args.json)
            console.print(f"wrote {args.json}")
        if args.plot is not None:
            from kvpool.plan.plots import write_plots
            for path in write_plots(result, args.plot):
                console.print(f"wrote {path}")
    except (RuntimeError, OSError) as exc:
        print(f"kvpool plan: {exc}", file=sys.stderr)
        return 2
    return 0


def _run_routing(args: argparse.Namespace, settings: PlanSettings, trace: Trace,
                 console: Console) -> int:
    """``--engines``: the routing simulation. Raises ValueError for a bad size or knob."""
    from kvpool.plan import routing
    from kvpool.plan.planner import dram_size
    from kvpool.plan.report import print_routing, write_json
    from kvpool.route.policy import TierWeights
    chunk = settings.chunk_bytes(trace)
    sizes = {flag: dram_size(getattr(args, flag), trace, chunk).chunks
             for flag in ("engine_cache", "host_pool", "storage")}
    rs = routing.RoutingSettings(
        engines=args.engines, policies=tuple(args.routing),
        engine_cache_chunks=sizes["engine_cache"], host_pool_chunks=sizes["host_pool"],
        storage_chunks=sizes["storage"], weights=TierWeights(*args.tier_weights),
        load_tokens=args.load_tokens, overload_factor=args.overload_factor,
        prefill_weight=args.prefill_weight)
    result = routing.run(trace, rs, settings.costs, chunk)
    result["cost_preset"] = settings.preset
    print_routing(result, console)
    if args.json is not None:
        try:
            write_json(result, args.json)
        except OSError as exc:
            print(f"kvpool plan: {exc}", file=sys.stderr)
            return 2
        console.print(f"wrote {args.json}")
    return 0
