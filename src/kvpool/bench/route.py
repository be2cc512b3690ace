"""``kvpool bench route``: two vLLM CPU servers behind ``kvpool route``, the KV-aware policy
beside round robin (the same proxy, ``--policy round_robin``, so both pay the same hop).

Workload: ``docs`` documents of ``prefix_len`` random token ids, ``questions`` questions of
``suffix_len`` tokens each, sent one at a time in a seeded shuffled order, each request a
streamed greedy completion of ``output_len`` tokens (``temperature`` 0, ``ignore_eos``,
``return_token_ids``); TTFT is the time to the first SSE data chunk. Each engine runs on its
own core (``VLLM_CPU_OMP_THREADS_BIND``) and publishes vLLM's KV events (ZMQ, with its
replay socket, which the routers ask when they miss a batch) to both routers. Round robin
and kv routing each get a fresh set of documents (another seed), so neither pass finds the
other's prefixes in the engines' caches. The first question of a
document is a miss under any policy; the later ones hit when they land on the engine that
already holds the document.

Set-ups (``--setups``):

* ``own``: the engines have only their own prefix caches (``route_ttft_p50_vs_round_robin``,
  target <= 0.6).
* ``shared``: both engines run kvpool's connector over one shared pool
  (:mod:`kvpool.bench.route_shared`: a ``kvpool host`` they attach to, or with
  ``--shared-pool node`` a ``kvpool serve`` node), so round robin also hits, one tier lower
  (``route_shared_ttft_p50_vs_round_robin``, target <= 0.95).

**Validity.** After both passes of a set-up every routed request is sent again straight to
the engine that answered it, without the router (the whole prompt is then in that engine's
prefix cache: another cache state than the routed request met); its output token ids
(``direct_token_ids``) must equal the routed answer's, and the prompt token ids the engine
reports must be the prompt sent. A set-up with any difference is reported ``valid: false``
and the command exits 1: its ratio is printed only with that verdict beside it. The engines
run in float32 by default: bf16 outputs on these CPU kernels can depend on how much of the
prompt came from the prefix cache (shared/notes/vllm-cpu.md), so in bf16 a routed request
and the direct one (another cache state) may pick different tokens with no routing fault
(``--dtype bfloat16`` runs them so). In float32 every answer of the measured run matched.

Failure contract: a missing vLLM venv or model raises BenchFailure naming the fix; a server
or router that does not come up fails the bench with the tail of its log; a kv router that
indexed no block fails it (that would measure least-loaded routing).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import kvpool
from kvpool.bench.serve import Server, Service, _counters, _free_port
from kvpool.bench.stats import BenchFailure, run_in_work_dir
from kvpool.bench.vllm import vllm_python

SETUPS = ("own", "shared")
RATIO_NAMES = {"own": "route_ttft_p50_vs_round_robin",
               "shared": "route_shared_ttft_p50_vs_round_robin"}
TARGETS = {"route_ttft_p50_vs_round_robin": "<= 0.6",
           "route_shared_ttft_p50_vs_round_robin": "<= 0.95"}
ROUTER_START_S = 120.0
#: Two engines start side by side on two cores; on a loaded machine (with a KV connector each)
#: that took 7-9 minutes here.
ENGINE_START_S = 1800.0


@dataclass(frozen=True)
class RouteWorkload:
    docs: int = 3
    questions: int = 3
    prefix_len: int = 1536
    suffix_len: int = 32
    output_len: int = 4
    seed: int = 0
    dtype: str = "float32"
    shared_pool: str = "host"  # kvpool.bench.route_shared.KINDS


def requests(load: RouteWorkload, seed: int) -> list[tuple[int, list[int]]]:
    """(document, token ids) per request, in send order: every document's questions,
    shuffled with ``seed`` (the same seed, the same list)."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1000, 20000, load.prefix_len).tolist() for _ in range(load.docs)]
    out = [(d, docs[d] + rng.integers(1000, 20000, load.suffix_len).tolist())
           for d in range(load.docs) for _ in range(load.questions)]
    random.Random(seed).shuffle(out)
    return out


def ratios(kv_ttfts: list[float], rr_ttfts: list[float], name: str = RATIO_NAMES["own"]
           ) -> dict[str, float]:
    """kv routing's TTFT over round robin's, at p50 (``name``) and p90 (``name`` with p90).
    Raises ValueError if either is empty."""
    if not kv_ttfts or not rr_ttfts:
        raise ValueError("no TTFTs to compare")
    kv, rr = np.asarray(kv_ttfts), np.asarray(rr_ttfts)
    return {name: float(np.percentile(kv, 50) / np.percentile(rr, 50)),
            name.replace("_p50_", "_p90_"): float(np.percentile(kv, 90)
                                                  / np.percentile(rr, 90))}


@dataclass
class Answer:
    """One streamed completion as the client saw it."""

    ttft_s: float
    text: str
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None  # as the engine reports it (first chunk)
    engine: str = ""  # X-Kvpool-Engine, "" without the router


def streamed(port: int, model: str, prompt: list[int], max_tokens: int) -> Answer:
    """One streamed greedy completion (``return_token_ids``); TTFT = seconds to the first
    data chunk. Raises OSError (urllib) if the server fails or answers an error status."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "ignore_eos": True,
                       "return_token_ids": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = 0.0
    text: list[str] = []
    tokens: list[int] = []
    prompt_ids: list[int] | None = None
    with urllib.request.urlopen(req, timeout=600) as resp:
        engine = resp.headers.get("X-Kvpool-Engine", "")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            if not first:
                first = time.perf_counter() - t0
            for c in json.loads(line[5:]).get("choices", []):
                text.append(c.get("text") or "")
                tokens.extend(c.get("token_ids") or ())
                if c.get("prompt_token_ids") is not None:
                    prompt_ids = list(c["prompt_token_ids"])
    return Answer(first, "".join(text), tokens, prompt_ids, engine)


def mismatch(prompt: list[int], routed: Answer, direct: Answer) -> str:
    """Why a routed answer is not the direct one ("" when it is): other output tokens, a
    prompt the engine saw otherwise, or an answer without token ids."""
    if not routed.token_ids or not direct.token_ids:
        return "no token ids in an answer"
    if routed.prompt_token_ids is not None and routed.prompt_token_ids != prompt:
        return "the engine saw another prompt"
    if routed.token_ids != direct.token_ids:
        return "other output tokens"
    if routed.text != direct.text:
        return "same tokens, other text"
    return ""


def _engine_number(name: str, engines: int) -> int:
    """``engineN`` (the router's X-Kvpool-Engine) -> N. Raises BenchFailure for another."""
    if name.startswith("engine") and name[6:].isdigit() and int(name[6:]) < engines:
        return int(name[6:])
    raise BenchFailure(f"the router named no engine it has ({name!r})")


class RouterProcess(Service):
    """``kvpool route`` in the vLLM venv (it has aiohttp, pyzmq, msgspec)."""

    def __init__(self, python: str, engines: list[tuple[int, int, int]], policy: str,
                 run_dir: Path, extra_args: tuple[str, ...] = (),
                 engine_suffix: str = "") -> None:
        self.port = _free_port()
        run_dir.mkdir(parents=True, exist_ok=True)
        src = str(Path(kvpool.__file__).resolve().parents[1])
        cmd = [python, "-c", "import sys; from kvpool.cli import main; sys.exit(main())",
               "route", "--port", str(self.port), "--policy", policy, *extra_args]
        for http, events, replay in engines:
            cmd += ["--engine", f"http://127.0.0.1:{http},events=tcp://127.0.0.1:{events},"
                    f"replay=tcp://127.0.0.1:{replay}{engine_suffix}"]
        super().__init__(f"kvpool route ({policy})", cmd, dict(os.environ, PYTHONPATH=src),
                         run_dir, run_dir / f"router-{policy}.log",
                         f"http://127.0.0.1:{self.port}/healthz", ROUTER_START_S)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            return str(r.read().decode())


def shared_pool_connector(pool_config: dict[str, Any], stats_path: Path) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for an engine of the shared set-up."""
    from kvpool.bench.serve import kvpool_transfer_config

    return kvpool_transfer_config(pool_config, stats_path, chunk_tokens=256)


def run_setup(setup: str, load: RouteWorkload, python: str, model: str, work: Path,
              connector: Callable[[int], dict[str, Any] | None],
              say: Callable[[str], None],
              routing: Callable[[], tuple[str, tuple[str, ...]]] | None = None
              ) -> dict[str, Any]:
    """Both passes of one set-up in two fresh engines (``connector(i)``: engine i's
    ``--kv-transfer-config`` or None), then the direct check. ``routing()``, asked once the
    engines answer: (a suffix for every ``--engine`` of the routers, extra router
    arguments): the shared pool's publisher. Raises BenchFailure."""
    events = [(_free_port(), _free_port()) for _ in range(2)]  # (PUB, replay) per engine
    say(f"{setup}: starting two vLLM servers ({load.dtype}), one core each, KV events on")
    cores = max(1, os.cpu_count() or 1)
    servers: list[Server] = []
    routers: dict[str, RouterProcess] = {}
    passes: dict[str, list[tuple[list[int], Answer, int]]] = {}
    try:
        for i in range(2):
            # "*": vLLM binds a wildcard endpoint (it connects to any other).
            cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
                   "endpoint": f"tcp://*:{events[i][0]}",
                   "replay_endpoint": f"tcp://*:{events[i][1]}", "topic": ""}
            servers.append(Server(python, model, work / f"{setup}-engine{i}", connector(i),
                                  env={"VLLM_CPU_OMP_THREADS_BIND": str(i % cores)},
                                  extra_args=("--kv-events-config", json.dumps(cfg)),
                                  dtype=load.dtype, wait=False,
                                  start_timeout_s=ENGINE_START_S))
        for s in servers:  # started side by side, each on its own core
            s.wait_healthy()
        pairs = [(s.port, *e) for s, e in zip(servers, events, strict=True)]
        suffix, extra = routing() if routing is not None else ("", ())
        for policy in ("kv", "round_robin"):
            routers[policy] = RouterProcess(python, pairs, policy, work / setup, extra, suffix)
        time.sleep(1.0)  # the routers' subscriptions reach the publishers
        for n, policy in enumerate(("round_robin", "kv")):
            reqs = requests(load, load.seed + 1 + n)
            say(f"{setup} {policy}: {len(reqs)} requests, {load.docs} documents x "
                f"{load.prefix_len} tokens")
            passes[policy] = [(prompt, streamed(routers[policy].port, model, prompt,
                                                load.output_len), doc)
                              for doc, prompt in reqs]
        say(f"{setup}: every routed request again, straight to the engine that answered it")
        rows: dict[str, list[dict[str, Any]]] = {}
        for policy, answers in passes.items():
            rows[policy] = []
            for prompt, routed, doc in answers:
                engine = servers[_engine_number(routed.engine, len(servers))]
                direct = streamed(engine.port, model, prompt, load.output_len)
                rows[policy].append({"doc": doc, "ttft_s": routed.ttft_s,
                                     "engine": routed.engine, "text": routed.text,
                                     "token_ids": routed.token_ids,
                                     "direct_text": direct.text,
                                     "direct_token_ids": direct.token_ids,
                                     "mismatch": mismatch(prompt, routed, direct)})
        metrics = routers["kv"].metrics()
    finally:
        for r in routers.values():
            r.stop()
        for s in servers:
            s.stop()
    indexed = [ln for ln in metrics.splitlines()
               if ln.startswith("kvpool_route_index_blocks") and not ln.endswith(" 0.0")]
    if not indexed:
        raise BenchFailure(f"{setup}: the kv router indexed no block from the engines' KV "
                           "events (a measurement of least-loaded routing, not of kv routing)")
    mismatched = sum(bool(r["mismatch"]) for rs in rows.values() for r in rs)
    return {"passes": rows,
            "ttft_p50_s": {p: float(np.percentile([r["ttft_s"] for r in rs], 50))
                           for p, rs in rows.items()},
            "ratios": ratios([r["ttft_s"] for r in rows["kv"]],
                             [r["ttft_s"] for r in rows["round_robin"]], RATIO_NAMES[setup]),
            "valid": mismatched == 0, "outputs_mismatched": mismatched,
            "kv_router_decisions": [ln for ln in metrics.splitlines()
                                    if ln.startswith("kvpool_route_decisions_total")],
            "kv_router_index_blocks": indexed}


def run_route_bench(load: RouteWorkload, setups: tuple[str, ...], work: Path,
                    json_path: str | None = None) -> dict[str, Any]:
    """Every set-up in ``setups``; one that fails is reported with its error (``valid``
    false) while the others' figures stand. Raises BenchFailure when all fail."""
    from kvpool.integrations.models.smollm2 import smollm2_hf_dir

    python = vllm_python()
    model = str(smollm2_hf_dir())

    def say(msg: str) -> None:
        print(f"[bench route] {msg}", file=sys.stderr, flush=True)

    report: dict[str, Any] = {"model": "SmolLM2-135M-Instruct", "workload": asdict(load),
                              "setups": {}, "targets": dict(TARGETS)}
    failures = []
    for setup in setups:
        try:
            report["setups"][setup] = _one_setup(setup, load, python, model, work, say)
        except BenchFailure as exc:  # the other set-up's figures still count
            say(f"{setup}: failed: {exc}")
            failures.append(f"{setup}: {exc}")
            text = str(exc)
            report["setups"][setup] = {"error": text if len(text) < 3000
                                       else f"{text[:500]}\n...\n{text[-2500:]}",
                                       "valid": False}
        if json_path:  # what is measured so far survives a later failure
            Path(json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(json_path).write_text(json.dumps(report, indent=1) + "\n")
    if len(failures) == len(setups):
        raise BenchFailure("\n".join(failures))
    done = [s for s in report["setups"].values() if "ratios" in s]
    report["ratios"] = {k: v for s in done for k, v in s["ratios"].items()}
    report["valid"] = all(s["valid"] for s in report["setups"].values())
    return report


def _one_setup(setup: str, load: RouteWorkload, python: str, model: str, work: Path,
               say: Callable[[str], None]) -> dict[str, Any]:
    if setup == "own":
        return run_setup(setup, load, python, model, work, lambda i: None, say)
    from kvpool.bench.route_shared import SharedPool

    with SharedPool(work / "shared-pool", say, load.shared_pool) as pool:
        stats = [work / f"stats{i}.json" for i in range(2)]
        result = run_setup(setup, load, python, model, work,
                           lambda i: pool.connector(stats[i]), say,
                           lambda: pool.router_args(stats))
        result["pool"] = pool.describe()
    # the engines' connector counters (written when they stop): the shared pool must have
    # served loads, else this set-up measured the engines' own caches only
    counters = [_counters(work / f"stats{i}.json") for i in range(2)]
    result["pool_counters"] = counters
    result["pool_loaded_chunks"] = sum(c.get("loaded_chunks", 0) for c in counters)
    return result


def _print(report: dict[str, Any]) -> None:
    w = report["workload"]
    print(f"kvpool route vs round robin, 2 vLLM CPU engines ({w['dtype']}), {report['model']}: "
          f"{w['docs']} documents x {w['prefix_len']} tokens, {w['questions']} questions "
          "each, one at a time")
    for setup, s in report["setups"].items():
        if "error" in s:
            print(f" set-up {setup}: FAILED: {s['error'].splitlines()[0]}")
            continue
        print(f" set-up {setup}:" + (f" {s['pool']}; chunks the engines loaded from kvpool: "
                                     f"{s['pool_loaded_chunks']}" if s.get("pool") else ""))
        for policy, rows in s["passes"].items():
            ttfts = ", ".join(f"{r['ttft_s'] * 1000:.0f}" for r in rows)
            print(f"  {policy:>12}: TTFT p50 {s['ttft_p50_s'][policy] * 1000:.0f} ms "
                  f"(each, ms: {ttfts})")
        for line in s["kv_router_decisions"]:
            print(f"  {line}")
        n = sum(len(rows) for rows in s["passes"].values())
        print(f"  outputs identical to a direct request: {n - s['outputs_mismatched']} of {n}"
              + ("" if s["valid"] else "  -> INVALID (each row keeps both answers)"))
        for name, value in s["ratios"].items():
            target = report["targets"].get(name)
            print(f"{name}: {value:.3f}" + (f" (target {target})" if target else "")
                  + ("" if s["valid"] else "  [valid: false]"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = RouteWorkload()
    parser.add_argument("--docs", type=int, default=d.docs, help="documents (default 3)")
    parser.add_argument("--questions", type=int, default=d.questions,
                        help="questions per document (default 3)")
    parser.add_argument("--prefix-len", type=int, default=d.prefix_len,
                        help="tokens per document (default 1536)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=d.dtype,
                        help="the engines' dtype (default float32: greedy outputs that do "
                             "not depend on the cache state)")
    parser.add_argument("--setups", default=",".join(SETUPS),
                        help="comma-separated: own (engine caches only), shared (both "
                             "engines on one kvpool pool); default both")
    parser.add_argument("--shared-pool", choices=("host", "node"), default=d.shared_pool,
                        help="the shared set-up's pool: one kvpool host both engines attach "
                             "to (default), or one kvpool serve node both use")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--work-dir", help="scratch directory (default: a temp dir)")


def run_from_args(args: argparse.Namespace) -> int:
    """Entry point of ``kvpool bench route``: 0 on a valid run, 1 when outputs differed from
    a direct request (the report says ``valid: false``), 2 when the bench cannot run."""
    setups = tuple(s for s in args.setups.split(",") if s)
    if min(args.docs, args.questions, args.prefix_len) < 1 or not setups or any(
            s not in SETUPS for s in setups):
        print("kvpool bench route: --docs, --questions, --prefix-len must be >= 1; --setups "
              f"a comma-separated subset of {','.join(SETUPS)}", file=sys.stderr)
        return 2
    load = RouteWorkload(docs=args.docs, questions=args.questions, prefix_len=args.prefix_len,
                         dtype=args.dtype, shared_pool=args.shared_pool)
    seen: dict[str, Any] = {}

    def run(work: Path) -> dict[str, Any]:
        seen.update(run_route_bench(load, setups, work, args.json))
        return seen

    rc = run_in_work_dir("route", args.work_dir, args.json, run, _print)
    if rc == 0 and not seen.get("valid", False):
        print("kvpool bench route: outputs differ from a direct request: the ratios are not "
              "valid", file=sys.stderr)
        return 1
    return rc
