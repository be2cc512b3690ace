"""The shared pool of ``kvpool bench route``'s ``shared`` set-up: one kvpool tier both vLLM
engines read and write through ``KVPoolConnector``, so that a document prefilled on one
engine is a pool hit on the other (round robin hits too, one tier below the engine's own
prefix cache).

The pool is one local ``kvpool serve`` storage node (DRAM only) that both engines' embedded
pools name in ``cluster.nodes``. Each engine's embedded pool keeps a small DRAM tier of its
own (the save path stages there) and no SSD: a document another engine prefilled is a read
from the shared node (loopback TCP), one the engine prefilled itself is in its own prefix
cache anyway.

Failure contract: a node that does not start raises BenchFailure with its output; ``close``
(the context manager's exit) terminates it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from kvpool.bench.remote_peers import Process
from kvpool.bench.serve import kvpool_transfer_config
from kvpool.bench.stats import BenchFailure

#: kvpool chunk of the shared set-up, in tokens (a multiple of vLLM's CPU block size, 128).
CHUNK_TOKENS = 256
NODE_DRAM = "2GiB"
ENGINE_DRAM = "512MiB"


class SharedPool:
    """One ``kvpool serve`` node in ``work`` for the engines of the shared set-up."""

    def __init__(self, work: Path, say: Callable[[str], None]) -> None:
        self.work = work
        work.mkdir(parents=True, exist_ok=True)
        cfg = {"cache_dir": str(work / "node"), "ssd": {"enabled": False},
               "dram": {"capacity": NODE_DRAM}, "metrics": {"enabled": False},
               "server": {"host": "127.0.0.1", "port": 0}}
        path = work / "node.yaml"
        path.write_text(yaml.safe_dump(cfg))
        say(f"shared: one kvpool serve node ({NODE_DRAM} DRAM) for both engines")
        try:
            self.node = Process([sys.executable, "-m", "kvpool.cli", "serve", "--config",
                                 str(path)], "listening on ", timeout_s=120.0)
        except RuntimeError as exc:
            raise BenchFailure(f"the shared kvpool serve node did not start: {exc}") from exc

    def connector(self, stats_path: Path) -> dict[str, Any]:
        """An engine's ``--kv-transfer-config``: an embedded pool with a small DRAM tier and
        no SSD, over the shared node."""
        name = stats_path.stem
        config = {"cache_dir": str(self.work / f"engine-{name}"), "ssd": {"enabled": False},
                  "dram": {"capacity": ENGINE_DRAM}, "metrics": {"enabled": False},
                  "cluster": {"nodes": [f"127.0.0.1:{self.node.port}"]}}
        return kvpool_transfer_config(config, stats_path, chunk_tokens=CHUNK_TOKENS)

    def describe(self) -> str:
        return (f"both engines' KVPoolConnector on one kvpool serve node (127.0.0.1:"
                f"{self.node.port}, DRAM only), {CHUNK_TOKENS}-token chunks")

    def close(self) -> None:
        self.node.close()

    def __enter__(self) -> SharedPool:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
