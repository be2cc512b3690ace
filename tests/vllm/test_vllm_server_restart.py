"""Saves survive a server stop (issue 11 item 6): a real vLLM OpenAI server with the kvpool
connector answers a request and is stopped with SIGTERM right after the response, as vLLM
stops by default (in-flight work aborted, the worker process force-killed within
milliseconds: the connector's shutdown may never run). A new server on the same cache_dir
must load that prompt's chunks and answer it token for token and logprob for logprob as the
first server did."""

from __future__ import annotations

import json
from pathlib import Path

from engine_support import BLOCK, P1, P1_CHUNKS

from kvpool.bench.serve import Server, kvpool_transfer_config


def test_a_server_stopped_right_after_a_request_keeps_its_saves(
        vllm_python: Path, vllm_home: Path, tiny_model: Path, tmp_path: Path) -> None:
    config = {"cache_dir": str(tmp_path / "pool"),
              "dram": {"capacity": "64MiB", "slab_size": "4MiB"},
              "ssd": {"capacity": "64MiB", "segment_size": "8MiB"}}  # default ssd_write
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(vllm_home / "vllm-cache"),
           "HF_HOME": str(vllm_home / "hf"), "VLLM_LOGGING_LEVEL": "WARNING"}
    answers, loaded = [], []
    for run in ("first", "restarted"):
        stats = tmp_path / run / "stats.json"
        server = Server(str(vllm_python), str(tiny_model), tmp_path / run,
                        kvpool_transfer_config(config, stats), max_model_len=2048, env=env)
        try:
            _, response = server.complete(P1, max_tokens=8)
        finally:
            server.stop()  # SIGTERM right after the response
        choice = response["choices"][0]
        answers.append((choice["text"], choice["logprobs"]["token_logprobs"]))
        loaded.append(json.loads(stats.read_text())["counters"]["loaded_chunks"]
                      if stats.exists() else None)
    assert loaded == [0, P1_CHUNKS], f"chunks of {BLOCK} tokens loaded per run: {loaded}"
    assert answers[1] == answers[0]
