"""KVPoolConnector in a real vLLM engine (tiny Llama, CPU), each run compared bit for bit
with a no-connector run of the same settings (greedy, one prompt at a time, vLLM's own
prefix cache off so only kvpool reuses KV).

Prompts: P1 (600 tokens = 4 full 128-token chunks + tail), P2 (shares P1's first 300 tokens:
2 full chunks), Q (unrelated, 600 tokens). The store run saves P1 and Q; each later test runs
a fresh engine on its own copy of that pool.
"""

from __future__ import annotations

import shutil
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

from kvpool.config import config_from_dict
from kvpool.integrations.vllm.layout import namespace_from_canonical
from kvpool.keys import KEY_BYTES
from kvpool.pool import KVPool
from kvpool.record import HEADER_BLOCK, MAGIC


def pool_settings(cache_dir: Path) -> dict[str, Any]:
    return {"cache_dir": str(cache_dir),
            "dram": {"capacity": "64MiB", "slab_size": "4MiB"},
            "ssd": {"capacity": "64MiB", "segment_size": "8MiB"},
            "pool": {"ssd_write": "through"}}


def spec(model: Path, prompts: list[list[int]], cache_dir: Path | None) -> dict[str, Any]:
    out: dict[str, Any] = {"model": str(model), "prompts": prompts, "max_tokens": 8,
                           "logprobs": 1, "block_size": BLOCK, "max_model_len": 2048}
    if cache_dir is not None:
        out["connector"] = {"name": "kvpool", "extra": {"config": pool_settings(cache_dir)}}
    return out


@pytest.fixture(scope="module")
def stored(run_engine: EngineRunner, tiny_model: Path, baseline: dict[str, Any],
           tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A pool holding P1's and Q's chunks, written by a single-process engine."""
    cache = tmp_path_factory.mktemp("stored") / "pool"
    result = run_engine(spec(tiny_model, [P1, Q], cache))
    assert outputs(result) == [outputs(baseline)[0], outputs(baseline)[2]]
    c = counters(result)
    assert c["stored_chunks"] == 2 * (len(P1) // BLOCK)  # every full prompt chunk, once
    assert c["loaded_tokens"] == 0 and c["dropped_chunks"] == 0
    engine = result["engine"]  # what kvpool bench vllm labels its runs with
    assert engine["device"] == "cpu" and engine["enforce_eager"] is True
    assert engine["model"] == str(tiny_model) and engine["vllm_version"]
    return cache, result


def copy_pool(stored: tuple[Path, dict[str, Any]], dest: Path) -> Path:
    shutil.copytree(stored[0], dest / "pool")
    return dest / "pool"


def test_hit_in_fresh_multiprocess_engine_full_and_partial(
        run_engine: EngineRunner, tiny_model: Path, baseline: dict[str, Any],
        stored: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """(a) + (b): scheduler and worker in different processes; P1 hits all but its tail,
    P2 hits the 2 chunks it shares with P1; outputs identical to recompute."""
    cache = copy_pool(stored, tmp_path)
    result = run_engine(spec(tiny_model, [P1, P2], cache), multiprocess=True)
    assert outputs(result) == outputs(baseline)[:2]
    c = counters(result)
    assert c["loaded_tokens"] == (P1_CHUNKS + P2_SHARED_CHUNKS) * BLOCK
    assert c["load_failed_chunks"] == 0
    assert c["stored_chunks"] == len(P2) // BLOCK - P2_SHARED_CHUNKS  # P2's own chunk only


def _flip_payload_byte(cache: Path, key: bytes) -> None:
    """Flip one payload byte of the SSD record holding ``key`` (the key sits 8 bytes into
    its 4 KiB header block)."""
    for seg in sorted((cache / "ssd").glob("*.kvs")):
        data = seg.read_bytes()
        pos = data.find(key)
        while pos >= 0:
            if pos % HEADER_BLOCK == 8 and data[pos - 8:pos - 4] == MAGIC:
                with open(seg, "r+b") as f:
                    f.seek(pos - 8 + HEADER_BLOCK + 1000)
                    b = f.read(1)
                    f.seek(-1, 1)
                    f.write(bytes([b[0] ^ 0xFF]))
                return
            pos = data.find(key, pos + 1)
    raise AssertionError("record not found in any segment")


def test_corrupt_chunk_is_recomputed(run_engine: EngineRunner, tiny_model: Path,
                                     baseline: dict[str, Any],
                                     stored: tuple[Path, dict[str, Any]],
                                     tmp_path: Path) -> None:
    """(e): P1's first chunk fails its checksum at load: the load fails from there, vLLM
    recomputes, the output is recompute's, the failure is counted."""
    cache = copy_pool(stored, tmp_path)
    ns = namespace_from_canonical(stored[1]["connector_stats"]["namespace"])
    key0 = ns.chunk_keys(P1)[0]
    assert len(key0) == KEY_BYTES
    _flip_payload_byte(cache, key0)
    cold = spec(tiny_model, [P1], cache)
    # no warm start, which would meet the bad chunk before the load does
    cold["connector"]["extra"]["config"]["pool"]["warm_start_fraction"] = 0
    result = run_engine(cold)
    assert outputs(result) == outputs(baseline)[:1]
    c = counters(result)
    assert c["load_failed_chunks"] == P1_CHUNKS  # chunk 0 bad: the whole prefix fails
    assert c["loaded_tokens"] == 0
    assert result["connector_stats"]["pool"]["ssd"]["checksum_failures"] >= 1
    assert c["stored_chunks"] >= 1  # the recomputed chunk 0 is saved again


def test_wrong_kv_changes_output(run_engine: EngineRunner, tiny_model: Path,
                                 baseline: dict[str, Any],
                                 stored: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """(f) negative control: Q's (valid, checksummed) KV stored under P1's keys is loaded and
    changes P1's output, so the loaded KV is really what the model attends to."""
    cache = copy_pool(stored, tmp_path)
    ns = namespace_from_canonical(stored[1]["connector_stats"]["namespace"])
    with KVPool(config_from_dict(pool_settings(cache))) as pool:
        pool.register_namespace(ns)
        buf = bytearray(ns.chunk_bytes)
        for p_key, q_key in zip(ns.chunk_keys(P1), ns.chunk_keys(Q), strict=True):
            assert pool.get_into(ns, q_key, buf)
            assert pool.delete(ns, p_key)
            assert pool.put(ns, p_key, bytes(buf))
    result = run_engine(spec(tiny_model, [P1], cache))
    c = counters(result)
    assert c["loaded_tokens"] == P1_CHUNKS * BLOCK
    assert outputs(result) != outputs(baseline)[:1]


@pytest.mark.parametrize(("threshold", "saved"), [(1.0, 0), (1e-9, len(P1) // BLOCK)])
def test_offload_threshold_reads_the_engines_kv_usage(
        run_engine: EngineRunner, tiny_model: Path, baseline: dict[str, Any], tmp_path: Path,
        threshold: float, saved: int) -> None:
    """offload_threshold against vLLM's own block pool (the scheduler binds it): P1 alone
    holds a few of the engine's blocks, so the usage is above 1e-9 (every full chunk saved)
    and below 1.0 (nothing saved). Outputs are recompute's either way."""
    s = spec(tiny_model, [P1], tmp_path / "pool")
    s["connector"]["extra"]["offload_threshold"] = threshold
    result = run_engine(s)
    assert outputs(result) == outputs(baseline)[:1]
    c = counters(result)
    assert c["stored_chunks"] == saved
    assert c["loaded_tokens"] == 0
