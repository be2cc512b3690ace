"""KVPoolConnector over a shared ``kvpool serve`` node (real vLLM engines, real node process):
(c) a second engine, with an empty local pool, hits what the first stored on the node;
(d) the node is killed with SIGKILL while an engine runs: it keeps serving, outputs identical.

One node for the module, filled once by a first engine (each engine run costs ~30 s on two
cores); the kill is the module's last test.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_support import (
    BLOCK,
    P1,
    P1_CHUNKS,
    P2,
    P2_SHARED_CHUNKS,
    EngineRunner,
    EngineStarter,
    Q,
    counters,
    outputs,
)
from node_process import NodeProcess

from kvpool.net.connection import NodeConnection


def cluster_spec(model: Path, prompts: list[list[int]], cache_dir: Path,
                 node: NodeProcess) -> dict[str, Any]:
    """An engine whose local pool starts empty and whose remote tier is ``node``."""
    config = {"cache_dir": str(cache_dir),
              "dram": {"capacity": "64MiB", "slab_size": "4MiB"},
              "ssd": {"capacity": "64MiB", "segment_size": "8MiB"},
              "cluster": {"nodes": [node.address], "retry_down_s": 60.0,
                          "request_timeout_s": 5.0}}
    return {"model": str(model), "prompts": prompts, "max_tokens": 8, "logprobs": 1,
            "block_size": BLOCK, "max_model_len": 2048,
            "connector": {"name": "kvpool", "extra": {"config": config}}}


def node_counter(node: NodeProcess, name: str) -> int:
    conn = NodeConnection(node.address, connect_timeout=2.0)
    try:
        value: int = conn.stats()["server"].get(name, 0)
        return value
    finally:
        conn.close()


@pytest.fixture(scope="module")
def filled_node(run_engine: EngineRunner, tiny_model: Path, baseline: dict[str, Any],
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """A node holding P1's and Q's chunks, stored by a first engine through its connector."""
    work = tmp_path_factory.mktemp("vllm-cluster")
    node = NodeProcess(work / "node")
    node.start()
    try:
        first = run_engine(cluster_spec(tiny_model, [P1, Q], work / "first", node))
        assert outputs(first) == [outputs(baseline)[0], outputs(baseline)[2]]
        assert node_counter(node, "put_chunks") == 2 * (len(P1) // BLOCK)
        yield node
    finally:
        node.stop()


def test_second_engine_hits_what_the_first_stored_on_the_node(
        run_engine: EngineRunner, tiny_model: Path, baseline: dict[str, Any],
        filled_node: NodeProcess, tmp_path: Path) -> None:
    node = filled_node
    second = run_engine(cluster_spec(tiny_model, [P1, P2], tmp_path / "b", node),
                        multiprocess=True)
    assert outputs(second) == outputs(baseline)[:2]
    c = counters(second)
    assert c["loaded_tokens"] == (P1_CHUNKS + P2_SHARED_CHUNKS) * BLOCK
    assert c["load_failed_chunks"] == 0
    pool = second["connector_stats"]["pool"]["pool"]
    assert pool["remote_hits"] >= P1_CHUNKS  # the local pool was empty: the node served them


def test_node_killed_mid_run_engine_keeps_serving_identical_outputs(
        start_engine: EngineStarter, run_engine: EngineRunner, tiny_model: Path,
        baseline: dict[str, Any], filled_node: NodeProcess, tmp_path: Path) -> None:
    node = filled_node
    prompts = [P1, Q, P1, P2]
    lookups_before = node_counter(node, "op_exists")
    engine = start_engine(cluster_spec(tiny_model, prompts, tmp_path / "b", node))
    deadline = time.monotonic() + 300
    while node_counter(node, "op_exists") == lookups_before \
            and time.monotonic() < deadline:
        if engine.proc.poll() is not None:
            break
        time.sleep(0.02)  # until the engine is serving its first request from the node
    node.kill9()
    result = engine.result()
    assert outputs(result) == [outputs(baseline)[i] for i in (0, 2, 0, 1)]
    remote = result["connector_stats"]["pool"]["remote"]["client"]
    assert remote["node_failures"] >= 1  # the engine really met the dead node
