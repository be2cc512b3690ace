"""The stores the demo compares, built fresh for each mode in a scratch directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpool.config import config_from_dict
from kvpool.demo.modes import MODES
from kvpool.integrations.hf import ChunkStore
from kvpool.peers.file_pool import FilePerChunkPool
from kvpool.pool import KVPool
from kvpool.record import round_up

#: With ``--metrics-port P``: the kvpool modes' pools serve their metrics on P + offset.
METRICS_PORT_OFFSET = {"kvpool": 0, "kvpool-ssd": 1}


def make_store(mode: str, workdir: Path, chunk_bytes: int, dram_bytes: int,
               ssd_bytes: int, metrics_port: int | None = None,
               request_bytes: int = 0) -> ChunkStore | None:
    """None for recompute. ``request_bytes``: the KV of the largest request; without a DRAM
    tier (kvpool-ssd) every save waits in the SSD's write-behind queue, so the queue gets
    room for two such requests (the default 256 MiB holds less than one 6K-token SmolLM2
    document, whose saves were dropped). Raises ValueError for an unknown mode, OSError when
    the metrics port cannot be bound."""
    slab = max(64 << 20, round_up(chunk_bytes))
    segment = max(256 << 20, 2 * round_up(chunk_bytes + 4096))
    base: dict[str, Any] = {
        "cache_dir": str(workdir / mode),
        "dram": {"capacity": dram_bytes, "slab_size": slab},
        "ssd": {"capacity": max(ssd_bytes, 2 * segment), "segment_size": segment},
    }
    if metrics_port is not None and mode in METRICS_PORT_OFFSET:
        base["metrics"] = {"port": metrics_port + METRICS_PORT_OFFSET[mode]}
    if mode == "recompute":
        return None
    if mode == "kvpool":
        return KVPool(config_from_dict(base))
    if mode == "kvpool-ssd":
        base["dram"]["capacity"] = 0
        room = max(256 << 20, 2 * request_bytes)
        base["pool"] = {"write_behind_bytes": room, "save_budget_bytes": room}
        return KVPool(config_from_dict(base))
    if mode == "file-per-chunk":
        return FilePerChunkPool(workdir / mode)
    raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")


def make_cold(store: ChunkStore | None) -> None:
    """Before each request: the file-per-chunk store loses its page cache, as its chunks
    would on a serving node whose page cache cannot hold the KV (kvpool-ssd reads with
    O_DIRECT, so it is always cold)."""
    if isinstance(store, FilePerChunkPool):
        store.drop_page_cache()


def tier_hits(store: ChunkStore | None) -> dict[str, int]:
    """Chunk hits per tier so far."""
    if isinstance(store, KVPool):
        p = store.stats()["pool"]
        return {"dram": p["dram_hits"] + p["staged_hits"], "ssd": p["ssd_hits"]}
    if isinstance(store, FilePerChunkPool):
        return {"files": store.stats()["file_per_chunk"]["hits"]}
    return {}


def dropped_saves(store: ChunkStore | None) -> int:
    """Saves the store dropped so far (a full write-behind queue, a failed write, no DRAM
    slot): each is a chunk a later request recomputes."""
    if not isinstance(store, KVPool):
        return 0
    stats = store.stats()
    staged = stats.get("write_behind", {})
    saves = stats.get("saves", {})
    return int(stats.get("dram", {}).get("dropped_puts", 0) + staged.get("dropped", 0)
               + staged.get("write_errors", 0)
               + sum(n for name, n in saves.items() if name.startswith("save_dropped_")))


def close_store(store: ChunkStore | None) -> None:
    if isinstance(store, KVPool | FilePerChunkPool):
        store.close()
