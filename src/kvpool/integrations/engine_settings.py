"""What the engine integrations' settings share (vLLM's ``kv_connector_extra_config``,
SGLang's HiCache extra config): the kvpool config they name, and one rank's copy of it.
Imports no engine."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from kvpool.config import Config, load_config
from kvpool.errors import ConfigError
from kvpool.integrations.retention import check_retention


def none_if_empty(value: object) -> object:
    return None if value == "" else value


def _a_mapping(value: object) -> object:
    if value is not None and not isinstance(value, Mapping):
        raise ValueError("must be a mapping of kvpool settings")
    return dict(value) if isinstance(value, Mapping) else None


class EngineSettings(BaseModel):
    """Base of an integration's settings model: every key optional, unknown keys refused."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())
    #: Who the ranks are, for the error about a raw SSD device shared by them.
    RANKS: ClassVar[str] = "ranks"

    config_path: str | None = Field(None, description="kvpool YAML file (the keys above); else `$KVPOOL_CONFIG`, else defaults. Must exist; `~` is expanded.")
    retention: Annotated[dict[str, Any] | None, BeforeValidator(check_retention)] = Field(None, description="What this engine's saves ask to be kept for (docs/retention.md): priority (pin, high, normal, ephemeral), pin_s or pin_until, ttl_s or expires_at, session; e.g. `{\"priority\": \"high\", \"ttl_s\": 3600}`. Relative times count from each save. A request's own retention (vLLM: kv_transfer_params[\"retention\"]) overrides it key by key.")
    config_overrides: Annotated[dict[str, Any] | None, BeforeValidator(_a_mapping)] = Field(None, alias="config", description="kvpool settings merged over the file, e.g. `{\"dram\": {\"capacity\": \"32GiB\"}}`; a mapping, validated as a kvpool config.")

    @field_validator("config_path")
    @classmethod
    def _existing_file(cls, value: str | None) -> str | None:
        if value is None:
            return None
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError("no such file")
        return str(path)

    def pool_config(self, tp_rank: int = 0, tp_size: int = 1) -> Config:
        """The kvpool config of one rank. With several ranks each gets its own SSD directory
        and shm file (``.../tp<rank>``: an embedded SSD engine must never be opened by two
        processes) and its metrics on ``metrics.port + rank`` (0 stays any free port).
        Raises ConfigError for a bad config."""
        cfg = load_config(self.config_path, overrides=self.config_overrides)
        if cfg.metrics.port:
            cfg.metrics.port += tp_rank
        if tp_size > 1:
            ssd_dir = cfg.ssd_path()
            if ssd_dir.exists() and not ssd_dir.is_dir():
                raise ConfigError(f"ssd.path: a raw device cannot be shared by {self.RANKS}; "
                                  "give each rank its own config")
            cfg.ssd.path = str(ssd_dir / f"tp{tp_rank}")
            if cfg.dram.shm_path:
                cfg.dram.shm_path = f"{cfg.dram.shm_path}.tp{tp_rank}"
        return cfg
