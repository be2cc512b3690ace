"""Renders the settings models as documentation: every knob, its default and its meaning.

``docs/config.md`` is ``config_markdown()`` (``kvpool config --doc``); tests/test_config.py
fails when the two differ, or when a field has no description.
"""

from __future__ import annotations

from pydantic import BaseModel

from kvpool.config import Config
from kvpool.integrations.vllm.settings import EXTRA_CONFIG, ConnectorSettings

#: Keys that were removed, and why; a file that still sets one is refused (unknown key).
REMOVED_KEYS = {
    "pool.chunk_tokens": "nothing read it: `PrefixCache(chunk_tokens=)` and the vLLM "
                         f"connector (`{EXTRA_CONFIG}.chunk_tokens`) set their own chunk size",
}


def _default_repr(value: object) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 20:
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20)):
            if value % size == 0:
                return f"{value // size}{unit}"
    if value is None:
        return "null"
    if value == "":
        return '""'
    return str(value).lower() if isinstance(value, bool) else str(value)


def settings_models() -> list[tuple[str, type[BaseModel]]]:
    """Every documented model with the key prefix its fields are shown under."""
    found: list[tuple[str, type[BaseModel]]] = [("", Config)]
    for name, field in Config.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            found.append((f"{name}.", field.annotation))
    return [*found, (f"{EXTRA_CONFIG}.", ConnectorSettings)]


def _rows(model: type[BaseModel], defaults: BaseModel | None, prefix: str = "") -> list[str]:
    """One table row per field; a nested section's fields under ``section.``. Defaults come
    from ``defaults`` where given (a model built with its defaults), else from the field; a
    field without one (its description says what it defaults to) shows as a dash."""
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{field.alias or name}"
        if defaults is None and field.is_required():
            rows.append(f"| `{key}` | - | {field.description} |")
            continue
        value = (getattr(defaults, name) if defaults is not None
                 else field.get_default(call_default_factory=True))
        if isinstance(value, BaseModel):
            rows.extend(_rows(type(value), value, f"{key}."))
        else:
            rows.append(f"| `{key}` | `{_default_repr(value)}` | {field.description} |")
    return rows


def config_markdown() -> str:
    """Markdown tables of every knob: kvpool's, then the vLLM connector's."""
    header = ["| key | default | meaning |", "| --- | --- | --- |"]
    lines = [
        "# kvpool configuration",
        "",
        "One YAML file (`--config FILE` where a command takes it, else `$KVPOOL_CONFIG`),",
        "then environment overrides `KVPOOL_<SECTION>__<KEY>` (e.g.",
        "`KVPOOL_DRAM__CAPACITY=8GiB`). Sizes take B, KiB, MiB, GiB, TiB (binary) or KB, MB, GB,",
        "TB (decimal). Unknown keys and bad values are refused with a message naming the key.",
        "`kvpool config` prints the effective settings; `kvpool config --doc` prints these tables.",
        "",
        *header,
        *_rows(Config, Config(cache_dir="~/.cache/kvpool")),
        "",
        f"## vLLM connector: `{EXTRA_CONFIG}`",
        "",
        "The connector ([vLLM with kvpool](vllm.md)) takes its settings from vLLM's",
        f"`{EXTRA_CONFIG}`, validated the same way: an unknown key or a bad value stops the",
        f"engine at start with a message naming the key (`{EXTRA_CONFIG}.chunk_tokens: ...`).",
        "Every key is optional.",
        "",
        *header,
        *_rows(ConnectorSettings, None),
        "",
        "## Removed keys",
        "",
        "A file that still sets one of these is refused (unknown key).",
        "",
        "| key | why |",
        "| --- | --- |",
        *(f"| `{key}` | {why} |" for key, why in REMOVED_KEYS.items()),
    ]
    return "\n".join(lines) + "\n"
