"""The shared pool of ``kvpool bench route``'s ``shared`` set-up: one kvpool tier both vLLM
engines read and write through ``KVPoolConnector``, so that a document prefilled on one
engine is a pool hit on the other (round robin hits too, one tier below the engine's own
prefix cache).

Two kinds (``--shared-pool``):

* ``host`` (the default): one ``kvpool host`` pool (DRAM only); both engines attach to it
  (``host: {socket: PATH}`` in the connector's config, ``kvpool.open_pool``): its arena is
  mapped into each engine, a load is a copy from shared memory.
* ``node``: one local ``kvpool serve`` storage node (DRAM only) that both engines' embedded
  pools name in ``cluster.nodes``. Each embedded pool keeps a small DRAM tier of its own
  (the save path stages there) and no SSD: a document the other engine prefilled is a read
  from the shared node over loopback TCP.

Either kind publishes its KV events on fixed ports (``router_args``), so the ``kv`` router
scores the shared pool's hits: a host pool's with the host tier's weight (``host=`` on every
engine: both attach to it), a node's with the storage tier's (``--storage-events``), for the
namespace the engines' connectors registered (their stats files name it).

Failure contract: a pool that does not start raises BenchFailure with its output; ``close``
(the context manager's exit) stops it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from kvpool.bench.remote_peers import Process, free_port
from kvpool.bench.serve import kvpool_transfer_config
from kvpool.bench.stats import BenchFailure
from kvpool.host.launch import HostProcess
from kvpool.keys import Namespace

KINDS = ("host", "node")
#: kvpool chunk of the shared set-up, in tokens (a multiple of vLLM's CPU block size, 128).
CHUNK_TOKENS = 256
POOL_DRAM = "2GiB"
ENGINE_DRAM = "512MiB"  # node kind: each engine's own staging tier


class SharedPool:
    """One shared pool of ``kind`` in ``work`` for the engines of the shared set-up, with
    ``pool_dram`` of DRAM (and ``engine_dram`` per engine for the node kind). Raises
    ValueError for an unknown kind."""

    def __init__(self, work: Path, say: Callable[[str], None], kind: str = "host",
                 pool_dram: str = POOL_DRAM, engine_dram: str = ENGINE_DRAM) -> None:
        if kind not in KINDS:
            raise ValueError(f"shared pool kind {kind!r}: one of {KINDS}")
        self.work, self.kind = work, kind
        self.pool_dram, self.engine_dram = pool_dram, engine_dram
        work.mkdir(parents=True, exist_ok=True)
        self._host: HostProcess | None = None
        self._node: Process | None = None
        self.socket = work / "host.sock"
        #: the pool's KV event publisher (PUB, replay), on 127.0.0.1
        self.events = (free_port(), free_port())
        cfg: dict[str, Any] = {"cache_dir": str(work / "pool"), "ssd": {"enabled": False},
                               "dram": {"capacity": pool_dram}, "metrics": {"enabled": False},
                               "events": {"host": "127.0.0.1", "port": self.events[0],
                                          "replay_port": self.events[1]}}
        path = work / "pool.yaml"
        say(f"shared: one kvpool {'host pool' if kind == 'host' else 'serve node'} "
            f"({pool_dram} DRAM) for both engines")
        try:
            if kind == "host":
                cfg["host"] = {"socket": str(self.socket), "shm_dir": str(work)}
                path.write_text(yaml.safe_dump(cfg))
                self._host = HostProcess(path, work / "host.log").start(120.0)
            else:
                cfg["server"] = {"host": "127.0.0.1", "port": 0}
                path.write_text(yaml.safe_dump(cfg))
                self._node = Process([sys.executable, "-m", "kvpool.cli", "serve", "--config",
                                      str(path)], "listening on ", timeout_s=120.0)
        except RuntimeError as exc:
            raise BenchFailure(f"the shared kvpool {kind} did not start: {exc}") from exc

    def connector(self, stats_path: Path) -> dict[str, Any]:
        """An engine's ``--kv-transfer-config`` onto the shared pool."""
        config: dict[str, Any] = {"cache_dir": str(self.work / f"engine-{stats_path.stem}"),
                                  "metrics": {"enabled": False}}
        if self._node is not None:
            config.update({"ssd": {"enabled": False}, "dram": {"capacity": self.engine_dram},
                           "cluster": {"nodes": [f"127.0.0.1:{self._node.port}"]}})
        else:
            config["host"] = {"socket": str(self.socket)}
        return kvpool_transfer_config(config, stats_path, chunk_tokens=CHUNK_TOKENS)

    def router_args(self, stats_paths: Sequence[Path]) -> tuple[str, tuple[str, ...]]:
        """What ``kvpool route`` needs to score this pool: (a suffix for every ``--engine``,
        extra arguments). The namespace id comes from the engines' connector stats files
        (``stats_paths``: written when a connector registers its namespace, before the
        engine answers /health). Raises BenchFailure when a file lacks it or they differ."""
        ids = set()
        for path in stats_paths:
            try:
                ids.add(Namespace.from_canonical(json.loads(path.read_text())["namespace"]).id)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise BenchFailure(f"{path}: no connector namespace ({exc})") from exc
        if len(ids) != 1:
            raise BenchFailure(f"the engines registered {len(ids)} namespaces, not one")
        pub, replay = (f"tcp://127.0.0.1:{p}" for p in self.events)
        args = ("--namespace-id", ids.pop().hex(), "--chunk-tokens", str(CHUNK_TOKENS))
        if self._node is not None:
            return "", (*args, "--storage-events", f"{pub},replay={replay}")
        return f",host={pub},host-replay={replay}", args

    def describe(self) -> str:
        if self._node is not None:
            return (f"both engines' KVPoolConnector on one kvpool serve node (127.0.0.1:"
                    f"{self._node.port}, DRAM only), {CHUNK_TOKENS}-token chunks")
        return (f"both engines' KVPoolConnector attached to one kvpool host pool "
                f"({self.pool_dram} DRAM), {CHUNK_TOKENS}-token chunks")

    def close(self) -> None:
        if self._host is not None:
            self._host.stop()
        if self._node is not None:
            self._node.close()

    def __enter__(self) -> SharedPool:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
