"""Two vLLM engine instances (two processes) attached to one ``kvpool host`` (issue 23 item
4): the connector of each opens its pool with ``kvpool.open_pool``, so ``host: {socket: ...}``
in its kvpool config attaches its worker to the host pool's shared DRAM arena instead of an
embedded pool. A prefix the first engine computed is a hit for the second, whose outputs are
identical, bit for bit, to a no-connector run of the same settings (``baseline``).

The engines run one after the other (the first has exited when the second starts: what the
second loads lives only in the host pool). The second runs in vLLM's default multi-process
mode, so its scheduler-side and worker-side connectors live in different processes.
"""

from __future__ import annotations

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
    Q,
    counters,
    outputs,
)
from host_support import host_config, start_host

from kvpool.host.launch import HostProcess


@pytest.fixture
def host(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A host pool with 64 MiB of DRAM and no SSD: a hit can only come from its arena."""
    data = host_config(tmp_path, dram={"capacity": "64MiB", "slab_size": "8MiB"},
                       host={"request_timeout_s": 30.0})
    proc: HostProcess = start_host(tmp_path, data)
    try:
        yield data
    finally:
        assert proc.stop() == 0


def attached(model: Path, prompts: list[list[int]], host: dict[str, Any],
             cache_dir: Path) -> dict[str, Any]:
    """A run spec whose kvpool config attaches to ``host`` (its own dram / ssd sections
    would not be used)."""
    return {"model": str(model), "prompts": prompts, "max_tokens": 8, "logprobs": 1,
            "block_size": BLOCK, "max_model_len": 2048,
            "connector": {"name": "kvpool", "extra": {"config": {
                "cache_dir": str(cache_dir),
                "host": {k: host["host"][k] for k in ("socket", "request_timeout_s")}}}}}


def test_a_prefix_one_engine_computed_is_a_hit_for_another_on_the_host_pool(
        run_engine: EngineRunner, tiny_model: Path, baseline: dict[str, Any],
        host: dict[str, Any], tmp_path: Path) -> None:
    first = run_engine(attached(tiny_model, [P1, Q], host, tmp_path / "a"))
    assert outputs(first) == [outputs(baseline)[0], outputs(baseline)[2]]
    c = counters(first)
    assert c["stored_chunks"] == 2 * (len(P1) // BLOCK) and c["dropped_chunks"] == 0
    assert c["loaded_tokens"] == 0
    second = run_engine(attached(tiny_model, [P1, P2], host, tmp_path / "b"),
                        multiprocess=True)
    assert outputs(second) == outputs(baseline)[:2]
    c = counters(second)
    # P1 from the first engine's chunks, P2's shared prefix as well
    assert c["loaded_tokens"] == (P1_CHUNKS + P2_SHARED_CHUNKS) * BLOCK
    assert c["load_failed_chunks"] == 0
    assert c["stored_chunks"] == len(P2) // BLOCK - P2_SHARED_CHUNKS
    # both workers were attached: neither wrote an SSD of its own
    assert not list((tmp_path / "a").rglob("*.kvs")) and not list((tmp_path / "b").rglob("*.kvs"))


#: bfloat16's machine epsilon: one rounding step of the values the model computes in.
BF16_EPS = 2.0 ** -7

#: Tensor parallelism on the 2-core CPU engine: one rank per core, gloo between them.
TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp",
       "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}


def test_tp2_both_ranks_attached_hit_what_another_tp2_engine_stored(
        run_engine: EngineRunner, tiny_model: Path, host: dict[str, Any],
        tmp_path: Path) -> None:
    """Both ranks of a TP=2 engine attach to the host pool (each rank its own shard, in its
    own namespace); a second TP=2 engine loads every chunk the first stored, and generates
    the first's tokens. The first engine's runs are full prefills (all misses: the reference,
    as a TP=2 run without a connector; TP=2 and TP=1 differ in bf16 rounding, and that a
    connector's misses change no output is checked at TP=1). Unlike TP=1, the logprobs of a
    hit at TP=2 are not bit for bit those of a full prefill (seen here: 3e-5 to 8e-3 apart at
    logprobs near -7, the ranks' reduction over a shorter prefill), so they are compared to
    within one bf16 epsilon, relative (the model runs in bf16: that is one rounding step).
    Two TP=2 engine runs, not three: each costs minutes on two cores."""
    first = run_engine({**attached(tiny_model, [P1, Q], host, tmp_path / "a"), **TP2})
    for c in (counters(first), first["rank_stats"]["1"]["counters"]):
        assert c["loaded_tokens"] == 0
        assert c["stored_chunks"] == 2 * (len(P1) // BLOCK) and c["dropped_chunks"] == 0
    second = run_engine({**attached(tiny_model, [P1, Q], host, tmp_path / "b"), **TP2})
    for (ids, lps), (ref_ids, ref_lps) in zip(outputs(second), outputs(first), strict=True):
        assert ids == ref_ids
        assert lps == pytest.approx(ref_lps, rel=BF16_EPS)
    for c in (counters(second), second["rank_stats"]["1"]["counters"]):  # each its shard
        assert c["loaded_tokens"] == 2 * P1_CHUNKS * BLOCK  # P1 and Q: 600 tokens each
        assert c["load_failed_chunks"] == 0
