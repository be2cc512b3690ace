"""Backend settings from SGLang's ``--hicache-storage-backend-extra-config`` (no SGLang import).

The extra config is one JSON object shared with SGLang: the keys SGLang itself reads
(``SGLANG_KEYS``: the dynamic loader's ``backend_name``, ``module_path``, ``class_name``,
``interface_v1``, ...) are passed over; every other key must be one of ``BackendSettings``'s
fields (``docs/sglang.md`` lists them).

Failure contract: an unknown key, a bad value or a ``config_path`` that is not a file raises
ConfigError when SGLang creates the backend, naming the key
(``hicache_storage_backend_extra_config.tenant_salt: ...``); a bad kvpool config (the file or
``config``) raises the ConfigError of ``kvpool.config``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from kvpool.config import Config, describe_errors, load_config
from kvpool.errors import ConfigError

#: Where SGLang takes these settings from; errors name their keys under it.
EXTRA_CONFIG = "hicache_storage_backend_extra_config"
#: Keys of the same JSON object that belong to SGLang (its dynamic loader and controller).
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1",
                         "interface_v2", "tp_lcm_size"})


def _none_if_empty(value: object) -> object:
    return None if value == "" else value


def _a_mapping(value: object) -> object:
    if value is not None and not isinstance(value, Mapping):
        raise ValueError("must be a mapping of kvpool settings")
    return dict(value) if isinstance(value, Mapping) else None


class BackendSettings(BaseModel):
    """The SGLang backend's settings (keys of the HiCache extra config); every one optional."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    config_path: str | None = Field(None, description="kvpool YAML file (the keys above); else `$KVPOOL_CONFIG`, else defaults. Must exist; `~` is expanded.")
    config_overrides: Annotated[dict[str, Any] | None, BeforeValidator(_a_mapping)] = Field(None, alias="config", description="kvpool settings merged over the file, e.g. `{\"dram\": {\"capacity\": \"32GiB\"}}`; a mapping, validated as a kvpool config.")
    model_id: Annotated[str | None, BeforeValidator(_none_if_empty)] = Field(None, description="Model identity in the namespace. Default: SGLang's model name (`--served-model-name`, else the model path).")
    tenant_salt: str = Field("", strict=True, description="Isolates tenants: different salts never share KV.")

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
        """The kvpool config of one SGLang rank. With several ranks in one machine each gets
        its own SSD directory and shm file (``.../tp<rank>``; an embedded SSD engine must never
        be opened by two processes) and metrics on ``metrics.port + rank``. Raises
        ConfigError for a bad config."""
        cfg = load_config(self.config_path, overrides=self.config_overrides)
        if cfg.metrics.port:
            cfg.metrics.port += tp_rank
        if tp_size > 1:
            ssd_dir = cfg.ssd_path()
            if ssd_dir.exists() and not ssd_dir.is_dir():
                raise ConfigError("ssd.path: a raw device cannot be shared by several SGLang "
                                  "ranks; give each rank its own config")
            cfg.ssd.path = str(ssd_dir / f"tp{tp_rank}")
            if cfg.dram.shm_path:
                cfg.dram.shm_path = f"{cfg.dram.shm_path}.tp{tp_rank}"
        return cfg


def parse_settings(extra: Mapping[str, Any] | None) -> BackendSettings:
    """Validate the kvpool keys of SGLang's extra config (SGLang's own keys are skipped) and
    the kvpool config they name. Raises ConfigError naming the bad key."""
    ours = {k: v for k, v in dict(extra or {}).items() if k not in SGLANG_KEYS}
    try:
        settings = BackendSettings.model_validate(ours)
    except ValidationError as err:
        raise ConfigError(describe_errors(err, EXTRA_CONFIG)) from None
    settings.pool_config()
    return settings
