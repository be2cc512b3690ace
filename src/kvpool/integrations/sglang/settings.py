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
from typing import Annotated, Any, ClassVar

from pydantic import BeforeValidator, Field, ValidationError

from kvpool.config import describe_errors
from kvpool.errors import ConfigError
from kvpool.integrations.engine_settings import EngineSettings, none_if_empty

#: Where SGLang takes these settings from; errors name their keys under it.
EXTRA_CONFIG = "hicache_storage_backend_extra_config"
#: Keys of the same JSON object that belong to SGLang (its dynamic loader and controller).
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1",
                         "interface_v2", "tp_lcm_size"})


class BackendSettings(EngineSettings):
    """The SGLang backend's settings (keys of the HiCache extra config); every one optional."""

    RANKS: ClassVar[str] = "several SGLang ranks"

    model_id: Annotated[str | None, BeforeValidator(none_if_empty)] = Field(None, description="Model identity in the namespace. Default: SGLang's model name (`--served-model-name`, else the model path).")
    tenant_salt: str = Field("", strict=True, description="Isolates tenants: different salts never share KV.")


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
