"""Worker-side counters of the vLLM connector, optionally mirrored to a JSON file.

The file exists for tests and benchmarks, which run the engine in another process: it is
rewritten atomically (temp file + rename) whenever a step moved KV, by a writer thread, so
the engine's step does not wait for it (0.8 ms a step inside a running engine, measured
2026-12-04: a bench's hit would carry it); a forced write (at close) is written at once. A
write error is logged and ignored; counters never affect inference.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import asdict, dataclass
from typing import Any

from kvpool.metrics.engine import EngineCounts

log = logging.getLogger("kvpool.integrations.vllm")


@dataclass
class ConnectorCounters:
    loaded_tokens: int = 0  # tokens whose pages were copied from the pool into engine blocks
    loaded_chunks: int = 0
    load_failed_chunks: int = 0  # misses or checksum failures at load time (recomputed)
    load_failed_blocks: int = 0
    stored_chunks: int = 0  # chunks the pool accepted
    dropped_chunks: int = 0  # saves dropped: budget full, no free slot, pool refused, failed step
    lookups: int = 0
    lookup_chunks: int = 0  # whole chunks of the prompts looked up
    lookup_hit_chunks: int = 0
    lookup_unsaved_chunks: int = 0  # of those, still being saved (not yet committed)
    load_wait_us: int = 0  # engine thread time waiting for reads and copying pages in
    save_gather_us: int = 0  # engine thread time gathering pages to store
    pins_refused: int = 0  # saves whose pins the pool refused (pool.max_pinned_fraction)
    sessions_released: int = 0  # release_session requests carried out


class StatsWriter:
    """Thread-safe counters plus the optional JSON mirror at ``path``."""

    def __init__(self, path: str | None, extra: dict[str, Any]) -> None:
        self.path = path
        self.counters = ConnectorCounters()
        self._extra = extra
        self._lock = threading.Lock()
        self._dirty = True
        self._file_lock = threading.Lock()  # one writer of the file at a time
        self._wake = threading.Event()
        self._writer: threading.Thread | None = None
        self._closed = False
        self._pool_stats: dict[str, Any] | None = None  # the last forced write's, kept

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, value in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + value)
            self._dirty = True

    def set_info(self, key: str, value: Any) -> None:
        with self._lock:
            self._extra[key] = value
            self._dirty = True

    def engine_counts(self, chunk_tokens: int) -> EngineCounts:
        """The counters as the engine metrics count them (tokens)."""
        with self._lock:
            c = self.counters
            return EngineCounts(
                lookup_hit_tokens=c.lookup_hit_chunks * chunk_tokens,
                lookup_miss_tokens=(c.lookup_chunks - c.lookup_hit_chunks) * chunk_tokens,
                prefill_tokens_saved=c.loaded_tokens, stored_tokens=c.stored_chunks * chunk_tokens)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"counters": asdict(self.counters), **self._extra}

    def write(self, pool_stats: dict[str, Any] | None = None, force: bool = False) -> None:
        """Mirror the counters to the file: forced (with ``pool_stats``), now on this thread;
        else, if they changed, soon on the writer thread. No-op without a path."""
        if self.path is None:
            return
        if force:
            self._write_now(pool_stats)
            return
        if not self._dirty or self._closed:
            return
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                            name="kvpool-stats")
            self._writer.start()
        self._wake.set()

    def close(self) -> None:
        """End the writer thread (after the last forced write); later writes that are not
        forced do nothing. Idempotent."""
        self._closed = True
        self._wake.set()
        if self._writer is not None:
            self._writer.join()

    def _write_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            if self._dirty:  # not written since by a forced write
                self._write_now(None)

    def _write_now(self, pool_stats: dict[str, Any] | None) -> None:
        assert self.path is not None
        with self._file_lock:
            with self._lock:
                self._dirty = False
            if pool_stats is not None:
                self._pool_stats = pool_stats
            data = self.snapshot()
            if self._pool_stats is not None:
                data["pool"] = self._pool_stats
            tmp = f"{self.path}.tmp{os.getpid()}"
            try:
                with open(tmp, "w") as f:
                    json.dump(data, f, indent=1, sort_keys=True, default=str)
                os.replace(tmp, self.path)
            except OSError as exc:
                log.warning("cannot write kvpool connector stats to %s: %s", self.path, exc)
