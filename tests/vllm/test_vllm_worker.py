"""Worker-side page copies of the vLLM connector on plain CPU tensors (no vLLM): pages saved
from some blocks come back bit for bit into others, in both registered KV layouts."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from kvpool.integrations.vllm.layout import EngineIdentity
from kvpool.integrations.vllm.plan import ChunkCopy, ReqTransfer
from kvpool.integrations.vllm.settings import parse_settings
from kvpool.integrations.vllm.worker import WorkerSide
from kvpool.pool import ChunkReservation

BLOCK, HEADS, HEAD, LAYERS, NBLOCKS = 16, 2, 8, 3, 12
IDENT = EngineIdentity("m", "main", HEADS, HEAD, BLOCK, "TEST", "0")


def caches(block_dim: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (NBLOCKS, HEADS, BLOCK, 2 * HEAD) if block_dim == 0 \
        else (2, NBLOCKS, BLOCK, HEADS, HEAD)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=g,
                                                            dtype=torch.bfloat16)
            for i in range(LAYERS)}


def page(kv: torch.Tensor, block: int, block_dim: int) -> torch.Tensor:
    return kv[block] if block_dim == 0 else kv[:, block]


@pytest.mark.parametrize("block_dim", [0, 1])
def test_saved_pages_load_back_into_other_blocks(tmp_path: Path, block_dim: int) -> None:
    settings = parse_settings({"chunk_tokens": 2 * BLOCK, "config": {
        "cache_dir": str(tmp_path), "dram": {"capacity": "8MiB", "slab_size": "1MiB"},
        "ssd": {"enabled": False}}}, BLOCK)
    w = WorkerSide(settings, IDENT, 0, 1, num_blocks=NBLOCKS)
    kv = caches(block_dim)
    try:
        w.register(kv)
        # host blocks with contiguous pages load as bytes, the [2, blocks, ...] layout by torch
        assert (w._host_kv is not None) == (block_dim == 0)
        store = [ReqTransfer("r", (ChunkCopy((b"k" * 16,), (3, 5)),))]
        for name in sorted(kv):  # what vLLM does per layer after attention
            w.save_layer(name, kv[name], store)
        w.end_step()
        assert w.flush(10)
        assert w.stats.counters.stored_chunks == 1
        # load into blocks 7 and 9, skipping the second page's twin (-1) in another chunk
        load = [ReqTransfer("s", (ChunkCopy((b"k" * 16,), (7, 9)),
                                  ChunkCopy((b"x" * 16,), (10, 11))))]
        w.start_load(load)
        for name in sorted(kv):
            w.wait_layer(name)
        assert w.take_load_errors() == {10, 11}  # the missing chunk is reported
        for name, t in kv.items():
            assert torch.equal(page(t, 7, block_dim), page(t, 3, block_dim)), name
            assert torch.equal(page(t, 9, block_dim), page(t, 5, block_dim)), name
        assert w.stats.counters.loaded_tokens == 2 * BLOCK
        assert w.stats.counters.load_failed_chunks == 1
    finally:
        w.close()


def test_a_chunk_handed_to_the_committer_is_found_and_loaded_before_it_is_committed(
        tmp_path: Path) -> None:
    """Read-your-writes: the request right after the one that stored a prefix finds it even
    while the committer is behind, and its load waits for that commit instead of missing.
    (The commit is held back with an Event: it only controls when the committer runs.)"""
    settings = parse_settings({"chunk_tokens": 2 * BLOCK, "config": {
        "cache_dir": str(tmp_path), "dram": {"capacity": "8MiB", "slab_size": "1MiB"},
        "ssd": {"enabled": False}}}, BLOCK)
    w = WorkerSide(settings, IDENT, 0, 1, num_blocks=NBLOCKS)
    kv = caches(0)
    release = threading.Event()
    try:
        w.register(kv)
        commit_many = w.pool.commit_many

        def held_commit(reservations: Sequence[ChunkReservation]) -> int:
            release.wait(10)
            return commit_many(reservations)

        w.pool.commit_many = held_commit  # type: ignore[method-assign]
        keys = (b"a" * 16, b"b" * 16)
        store = [ReqTransfer("r", (ChunkCopy((keys[0],), (1, 2)), ChunkCopy((keys[1],), (3, 4))))]
        for name in sorted(kv):
            w.save_layer(name, kv[name], store)
        w.end_step()
        assert w.pool.saving_many(w.ns, keys) == [True, True]  # not committed yet...
        assert w._lookup([*keys, b"c" * 16]) == 2  # ...but found
        w.start_load([ReqTransfer("s", (ChunkCopy((keys[0],), (7, 8)),))])
        threading.Timer(0.2, release.set).start()  # the committer catches up meanwhile
        for name in sorted(kv):
            w.wait_layer(name)
        assert w.take_load_errors() == set()
        for t in kv.values():
            assert torch.equal(t[7], t[1]) and torch.equal(t[8], t[2])
        assert w.stats.counters.lookup_unsaved_chunks == 2
        assert w.pool.stats()["saves"]["load_commit_timeouts"] == 0
    finally:
        release.set()
        w.close()


@pytest.mark.parametrize(("window", "moved"), [(None, 4), (3 * BLOCK, 2), (0, 0)])
def test_a_lookup_reads_ahead_prefetch_window_tokens_of_an_ssd_prefix(
        tmp_path: Path, window: int | None, moved: int) -> None:
    """After a restart only the SSD holds the prefix; the lookup starts moving the first
    prefetch_window_tokens of it (rounded up to 2-block chunks; default 16 chunks) up to DRAM."""
    extra: dict[str, object] = {"chunk_tokens": 2 * BLOCK, "config": {
        "cache_dir": str(tmp_path), "dram": {"capacity": "8MiB", "slab_size": "1MiB"},
        "ssd": {"capacity": "8MiB", "segment_size": "1MiB"},
        "pool": {"warm_start_fraction": 0}}}  # the restart leaves the prefix on SSD only
    if window is not None:
        extra["prefetch_window_tokens"] = window
    settings = parse_settings(extra, BLOCK)
    keys = [bytes([i]) * 16 for i in range(4)]
    kv = caches(0)
    w = WorkerSide(settings, IDENT, 0, 1, num_blocks=NBLOCKS)
    try:
        w.register(kv)
        store = [ReqTransfer("r", tuple(ChunkCopy((key,), (2 * i, 2 * i + 1))
                                        for i, key in enumerate(keys)))]
        for name in sorted(kv):
            w.save_layer(name, kv[name], store)
        w.end_step()
        assert w.flush(10)
    finally:
        w.close()
    w = WorkerSide(settings, IDENT, 0, 1, num_blocks=NBLOCKS)
    try:
        w.register(kv)
        assert w._lookup(keys) == 4
        assert w.pool.flush(10)
        stats = w.pool.stats()
        assert stats["pool"].get("prefetched", 0) == moved
        assert stats["dram"]["entries"] == moved
    finally:
        w.close()


def test_engine_metrics_are_served_per_rank_on_metrics_port_plus_rank(tmp_path: Path) -> None:
    """A rank-1 worker serves metrics.port + 1: the lookups, loads and saves it did, in
    tokens, beside its pool's own metrics."""
    import socket

    from metrics_support import scrape_url, value
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        base = int(sock.getsockname()[1]) - 1  # rank 1 gets the port just probed
    settings = parse_settings({"chunk_tokens": 2 * BLOCK, "config": {
        "cache_dir": str(tmp_path), "dram": {"capacity": "8MiB", "slab_size": "1MiB"},
        "ssd": {"enabled": False}, "metrics": {"port": base}}}, BLOCK)
    w = WorkerSide(settings, IDENT, 1, 2, num_blocks=NBLOCKS)
    kv = caches(0)
    try:
        assert w.pool.metrics_url == f"http://127.0.0.1:{base + 1}/metrics"
        w.register(kv)
        key, other = b"k" * 16, b"x" * 16
        keys = (b"0" * 16, key)  # each rank's key of the chunk
        store = [ReqTransfer("r", (ChunkCopy(keys, (3, 5)),))]
        for name in sorted(kv):
            w.save_layer(name, kv[name], store)
        w.end_step()
        assert w.flush(10)
        assert w.server is not None
        assert w.server.lookup([key, other]) == 1
        w.start_load([ReqTransfer("s", (ChunkCopy(keys, (7, 9)),))])
        for name in sorted(kv):
            w.wait_layer(name)
        s = scrape_url(w.pool.metrics_url)
        tokens = 2 * BLOCK  # one chunk
        assert value(s, "kvpool_engine_lookup_tokens_total", engine="vllm", result="hit") \
            == tokens
        assert value(s, "kvpool_engine_lookup_tokens_total", engine="vllm", result="miss") \
            == tokens
        assert value(s, "kvpool_engine_prefill_tokens_saved_total", engine="vllm") == tokens
        assert value(s, "kvpool_engine_stored_tokens_total", engine="vllm") == tokens
        assert value(s, "kvpool_lookups_total") >= 1
    finally:
        w.close()
