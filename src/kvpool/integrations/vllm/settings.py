"""Connector settings from ``kv_connector_extra_config`` and the kvpool config they name.

Recognised keys (all optional):

``config_path``       kvpool YAML file (else ``$KVPOOL_CONFIG``, else defaults)
``config``            dict of kvpool settings merged over the file (``load_config(overrides=)``)
``chunk_tokens``      tokens per pool chunk; a multiple of vLLM's block size (default: the
                      block size)
``model_id``          model identity in the namespace (default: the served model name)
``tenant_salt``       isolates tenants: different salts never share KV
``lookup_timeout_s``  how long a scheduler-side lookup waits for the worker (default 2.0)
``stats_path``        the worker writes its counters here as JSON after each step that moved
                      KV (for tests and benchmarks; rank r > 0 writes ``<path>.tp<r>``)

Failure contract: an unknown key, a bad value or a chunk size that is not a multiple of the
block size raises ConfigError at engine start, naming the key; a bad kvpool config raises the
ConfigError of ``kvpool.config``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.config import Config, load_config
from kvpool.errors import ConfigError

_KEYS = {"config_path", "config", "chunk_tokens", "model_id", "tenant_salt", "lookup_timeout_s",
         "stats_path"}


@dataclass(frozen=True)
class ConnectorSettings:
    chunk_tokens: int
    block_size: int
    config_path: str | None = None
    config_overrides: Mapping[str, Any] | None = None
    model_id: str | None = None
    tenant_salt: str = ""
    lookup_timeout_s: float = 2.0
    stats_path: str | None = None

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_size

    def pool_config(self, tp_rank: int = 0, tp_size: int = 1) -> Config:
        """The kvpool config of one worker rank. With tensor parallelism every rank gets its own
        SSD directory and shm file (``.../tp<rank>``): an embedded SSD engine must never be
        opened by two processes. Raises ConfigError for a bad config."""
        cfg = load_config(self.config_path, overrides=self.config_overrides)
        if tp_size > 1:
            ssd_dir = cfg.ssd_path()
            if ssd_dir.exists() and not ssd_dir.is_dir():
                raise ConfigError("ssd.path: a raw device cannot be shared by tensor-parallel "
                                  "ranks; give each rank its own config")
            cfg.ssd.path = str(ssd_dir / f"tp{tp_rank}")
            if cfg.dram.shm_path:
                cfg.dram.shm_path = f"{cfg.dram.shm_path}.tp{tp_rank}"
        return cfg


def parse_settings(extra: Mapping[str, Any] | None, block_size: int) -> ConnectorSettings:
    """Validate ``kv_connector_extra_config``. Raises ConfigError naming the bad key."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - _KEYS)
    if unknown:
        raise ConfigError(f"kv_connector_extra_config: unknown key(s) {unknown}; known: "
                          f"{sorted(_KEYS)}")
    chunk = extra.get("chunk_tokens", block_size)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0 \
            or chunk % block_size:
        raise ConfigError(f"kv_connector_extra_config.chunk_tokens: must be a positive multiple "
                          f"of the vLLM block size {block_size}, got {chunk!r}")
    overrides = extra.get("config")
    if overrides is not None and not isinstance(overrides, Mapping):
        raise ConfigError("kv_connector_extra_config.config: must be a mapping of kvpool "
                          "settings")
    path = extra.get("config_path")
    if path is not None and not Path(str(path)).expanduser().is_file():
        raise ConfigError(f"kv_connector_extra_config.config_path: no such file {path!r}")
    timeout = extra.get("lookup_timeout_s", 2.0)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        raise ConfigError(f"kv_connector_extra_config.lookup_timeout_s: must be a positive "
                          f"number, got {timeout!r}")
    settings = ConnectorSettings(
        chunk_tokens=chunk, block_size=block_size,
        config_path=str(Path(str(path)).expanduser()) if path is not None else None,
        config_overrides=dict(overrides) if overrides is not None else None,
        model_id=str(extra["model_id"]) if extra.get("model_id") else None,
        tenant_salt=str(extra.get("tenant_salt", "")),
        lookup_timeout_s=float(timeout),
        stats_path=str(extra["stats_path"]) if extra.get("stats_path") else None,
    )
    settings.pool_config()  # fail at start-up, in the scheduler too, on a bad kvpool config
    return settings
