"""Run one vLLM engine over a list of prompts and write JSON (tests and ``kvpool bench vllm``).

Runs in the vLLM venv: ``python -m kvpool.integrations.vllm.run_engine SPEC.json OUT.json``.
SPEC keys: ``model`` (local HF dir), ``prompts`` (lists of token ids), ``max_tokens``,
``logprobs`` (int or null), ``repeats`` (each prompt is run this many times in a row, default
1), ``connector`` (null, or {"name": "kvpool"|"example", "extra": {...}}), and engine options
``block_size``, ``max_model_len``, ``max_num_batched_tokens``, ``enable_prefix_caching``
(default false: only the connector reuses KV), ``dtype``, ``seed``, ``tensor_parallel_size``
and ``distributed_executor_backend`` (on CPU, TP=2 needs ``"mp"`` and
``VLLM_CPU_OMP_THREADS_BIND="0|1"``: one rank per core), ``env`` (variables set before
vLLM is imported).
OUT: ``{"outputs": [{"token_ids", "logprobs", "wall_s"}...], "connector_stats": {...},
"rank_stats": {...}, "engine": {...}}``; ``connector_stats`` is what the kvpool worker wrote
at shutdown (rank 0), or null; ``rank_stats`` the same of the other tensor-parallel ranks, by
rank ("1": {...}); ``engine`` is what ran, as vLLM resolved it (see ``engine_info``).

Prompts run one at a time (one ``generate`` call each), so batch composition is the same in
every run and greedy outputs can be compared bit for bit. Any engine error propagates (exit
status 1): the caller sees the traceback on stderr.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _kv_transfer(spec: dict[str, Any], stats_path: str) -> Any:
    from vllm.config import KVTransferConfig

    conn = spec.get("connector")
    if not conn:
        return None
    if conn["name"] == "kvpool":
        extra = dict(conn.get("extra") or {})
        extra.setdefault("stats_path", stats_path)
        return KVTransferConfig(kv_connector="KVPoolConnector",
                                kv_connector_module_path="kvpool.integrations.vllm",
                                kv_role="kv_both", kv_load_failure_policy="recompute",
                                kv_connector_extra_config=extra)
    if conn["name"] == "example":
        return KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                kv_connector_extra_config=dict(conn.get("extra") or {}))
    raise ValueError(f"unknown connector {conn['name']!r}")


def engine_info(llm: Any) -> dict[str, Any]:
    """What this engine is: vLLM version, device type, the dtype vLLM resolved for the model
    (``"auto"`` depends on the model and the host), eager or compiled, and the model path."""
    import vllm
    from vllm.platforms import current_platform

    mc = llm.llm_engine.model_config
    return {"vllm_version": vllm.__version__, "device": current_platform.device_type,
            "dtype": str(mc.dtype).removeprefix("torch."), "enforce_eager": bool(mc.enforce_eager),
            "model": str(mc.model)}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ.update({str(k): str(v) for k, v in (spec.get("env") or {}).items()})
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    stats_dir = tempfile.mkdtemp(prefix="kvpool-stats-")
    stats_path = os.path.join(stats_dir, "stats.json")
    kwargs: dict[str, Any] = {
        "model": spec["model"], "tokenizer": spec["model"], "enforce_eager": True,
        "dtype": spec.get("dtype", "auto"), "seed": spec.get("seed", 0),
        "enable_prefix_caching": spec.get("enable_prefix_caching", False),
        "kv_transfer_config": _kv_transfer(spec, stats_path),
    }
    for key in ("block_size", "max_model_len", "max_num_batched_tokens", "max_num_seqs",
                "tensor_parallel_size", "distributed_executor_backend"):
        if spec.get(key) is not None:
            kwargs[key] = spec[key]
    llm = LLM(**kwargs)
    engine = engine_info(llm)
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 8),
                            logprobs=spec.get("logprobs"), ignore_eos=True)
    outputs = []
    for prompt in spec["prompts"]:
        for _ in range(int(spec.get("repeats", 1))):
            start = time.perf_counter()
            res = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params,
                               use_tqdm=False)[0]
            wall = time.perf_counter() - start
            comp = res.outputs[0]
            logprobs = None
            if comp.logprobs is not None:
                logprobs = [float(lp[t].logprob) for t, lp in zip(comp.token_ids, comp.logprobs,
                                                                   strict=True)]
            outputs.append({"token_ids": list(comp.token_ids), "logprobs": logprobs,
                            "wall_s": wall})
    llm.llm_engine.engine_core.shutdown()
    del llm
    stats = None
    if os.path.exists(stats_path):
        stats = json.loads(Path(stats_path).read_text())
    ranks = {p.suffix.removeprefix(".tp"): json.loads(p.read_text())
             for p in Path(stats_dir).glob("stats.json.tp*")}
    shutil.rmtree(stats_dir, ignore_errors=True)
    return {"outputs": outputs, "connector_stats": stats, "rank_stats": ranks,
            "engine": engine}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    result = run(spec)
    Path(argv[2]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
