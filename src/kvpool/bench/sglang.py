"""``kvpool bench sglang``: kvpool as SGLang's HiCache L3 backend beside SGLang's bundled
``file`` backend, on SGLang's real host pool.

Pages of a SmolLM2-sized layout (30 layers, 3 KV heads, head dim 64, bf16) at 64 and 256
tokens per page; pages/s and GB/s of storing and reading them (``batch_set_v1`` /
``batch_get_v1`` through the host pool's addresses for kvpool, the controller's generic flat
page path for ``file``), median and p99 per page over the repeats. Systems: kvpool embedded
(DRAM, written through to its SSD), kvpool through one ``kvpool serve`` node started here
(the client keeps no DRAM of its own, so every read crosses loopback), and ``file`` (one file
per page; page cache dropped before reads). The measuring runs in the pinned SGLang venv
(``kvpool.bench.sglang_runner``); see there for what each call does.

``ratios``: ``get_v1_vs_file_backend`` and ``set_v1_vs_file_backend`` = kvpool embedded pages/s
over file's, at the largest page size (> 1: kvpool faster; target >= 3 on get), and the same
per page size and for the node.

Failure contract: a missing SGLang venv raises BenchFailure naming ``bash
scripts/sglang-env.sh``; a failed call or a wrong byte fails the bench with the runner's
stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from kvpool.bench.remote_peers import Process
from kvpool.bench.stats import BenchFailure, run_in_work_dir

ROOT = Path(__file__).resolve().parents[3]
PAGE_SIZES = (64, 256)
#: Pages per pass and per call: about 47 MB per call, at most 128 pages (SGLang's limit).
BATCH = {"64": 32, "256": 8}
FULL: dict[str, Any] = {"pages": {"64": 128, "256": 32}, "batch": BATCH, "repeats": 5}
QUICK: dict[str, Any] = {"pages": {"64": 64, "256": 16}, "batch": BATCH, "repeats": 3}
TARGETS = {"get_v1_vs_file_backend": ">= 3"}
SYSTEMS = ("kvpool", "kvpool_node", "file")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer pages and repeats")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--repeats", type=int, default=None, help="passes per case")
    parser.add_argument("--no-node", action="store_true", help="skip the kvpool serve node")
    parser.add_argument("--work-dir", help="scratch directory (default: a temp dir)")


def page_bytes(page_tokens: int) -> int:
    """Bytes of one page of the benchmarked layout (K and V of 30 layers, 3 heads of 64, bf16)."""
    return page_tokens * 30 * 2 * 3 * 64 * 2


def sglang_python() -> str:
    """The pinned SGLang venv's python. Raises BenchFailure when it is missing."""
    venv = Path(os.environ.get("SGLANG_VENV", ROOT / ".venv-sglang")) / "bin" / "python"
    if not venv.exists():
        raise BenchFailure(f"{venv} is missing; create it with: bash scripts/sglang-env.sh")
    return str(venv)


def _start_node(work: Path, capacity: int) -> Process:
    cfg = {"cache_dir": str(work / "node"), "dram": {"capacity": capacity},
           "ssd": {"enabled": False}, "server": {"host": "127.0.0.1", "port": 0}}
    path = work / "node.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return Process([sys.executable, "-m", "kvpool.cli", "serve", "--config", str(path)],
                   "listening on ")


def run_sglang_bench(quick: bool, repeats: int | None, node: bool,
                     work: Path) -> dict[str, Any]:
    python = sglang_python()
    plan = dict(QUICK if quick else FULL)
    if repeats:
        plan["repeats"] = repeats
    spec: dict[str, Any] = {**plan, "work": str(work / "runs"), "page_sizes": list(PAGE_SIZES)}
    # Every pass writes fresh pages: the node's DRAM holds them all (it has no SSD here).
    stored = plan["repeats"] * sum(plan["pages"][str(p)] * page_bytes(p) for p in PAGE_SIZES)
    server = _start_node(work, stored * 5 // 4 + (256 << 20)) if node else None
    try:
        if server is not None:
            spec["node"] = f"127.0.0.1:{server.port}"
        (work / "runs").mkdir(parents=True, exist_ok=True)
        spec_path, out_path = work / "spec.json", work / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
        env.update({"HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"})
        proc = subprocess.run([python, "-m", "kvpool.bench.sglang_runner", str(spec_path),
                               str(out_path)], env=env, cwd=work, capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise BenchFailure(f"the SGLang runner failed:\n{proc.stderr[-4000:]}")
        results: dict[str, Any] = json.loads(out_path.read_text())
    finally:
        if server is not None:
            server.close()
    return {"layout": "page_first", "model_layout": "SmolLM2-135M: 30 layers, 3 KV heads x 64, "
            "bf16", "page_sizes": list(PAGE_SIZES), "plan": plan, "pages": results,
            "ratios": ratios(results), "targets": dict(TARGETS)}


def ratios(results: dict[str, Any]) -> dict[str, float]:
    """kvpool's pages/s over file's: the headline at the largest page size, then per page size
    (``*_<tokens>``) and for the node (``*_node_*``). Raises KeyError for missing rows."""
    big = str(max(PAGE_SIZES))
    out = {f"{op}_v1_vs_file_backend": results[big]["kvpool"][op]["ops_per_s"]
           / results[big]["file"][op]["ops_per_s"] for op in ("get", "set")}
    for op in ("get", "set"):
        for page, row in results.items():
            file_rate = row["file"][op]["ops_per_s"]
            out[f"{op}_v1_vs_file_backend_{page}"] = row["kvpool"][op]["ops_per_s"] / file_rate
            if "kvpool_node" in row:
                out[f"{op}_v1_node_vs_file_backend_{page}"] = \
                    row["kvpool_node"][op]["ops_per_s"] / file_rate
    return out


def _print(report: dict[str, Any]) -> None:
    print(f"SGLang HiCache L3, host layout {report['layout']}, {report['model_layout']}: "
          f"pages/s and GB/s per pass (median), per-page latency median / p99")
    print(f"{'page':>6} {'system':>12} {'op':>4} {'pages/s':>10} {'GB/s':>8} "
          f"{'median ms':>10} {'p99 ms':>9}")
    for page, row in report["pages"].items():
        for system in SYSTEMS:
            if system not in row:
                continue
            for op in ("set", "get"):
                r = row[system][op]
                print(f"{page:>6} {system:>12} {op:>4} {r['ops_per_s']:10.1f} "
                      f"{r['gb_per_s']:8.3f} {r['median_s'] * 1e3:10.3f} {r['p99_s'] * 1e3:9.3f}")
    for name, value in report["ratios"].items():
        target = report["targets"].get(name)
        print(f"{name}: {value:.2f}" + (f" (target {target})" if target else ""))


def run_from_args(args: argparse.Namespace) -> int:
    """Entry point of ``kvpool bench sglang``; 0 on success, 2 when the bench cannot run."""
    return run_in_work_dir("sglang", args.work_dir, args.json,
                           lambda work: run_sglang_bench(args.quick, args.repeats,
                                                         not args.no_node, work), _print)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpool bench sglang", description=__doc__)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
