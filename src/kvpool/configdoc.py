"""Renders the settings model as documentation: every knob, its default and its meaning."""

from __future__ import annotations

from pydantic import BaseModel

from kvpool.config import Config


def _default_repr(value: object) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 20:
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20)):
            if value % size == 0:
                return f"{value // size}{unit}"
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def config_markdown() -> str:
    """Markdown table of every knob (docs/config.md is this output; a test keeps it equal)."""
    lines = [
        "# kvpool configuration",
        "",
        "One YAML file (`--config FILE` where a command takes it, else `$KVPOOL_CONFIG`),",
        "then environment overrides `KVPOOL_<SECTION>__<KEY>` (e.g.",
        "`KVPOOL_DRAM__CAPACITY=8GiB`). Sizes take B, KiB, MiB, GiB, TiB (binary) or KB, MB, GB,",
        "TB (decimal). Unknown keys and bad values are refused with a message naming the key.",
        "`kvpool config` prints the effective settings; `kvpool config --doc` prints this table.",
        "",
        "| key | default | meaning |",
        "| --- | --- | --- |",
    ]
    defaults = Config(cache_dir="~/.cache/kvpool")
    for name, field in Config.model_fields.items():
        value = getattr(defaults, name)
        if isinstance(value, BaseModel):
            for sub, subfield in type(value).model_fields.items():
                lines.append(f"| `{name}.{sub}` | `{_default_repr(getattr(value, sub))}` | "
                             f"{subfield.description} |")
        else:
            lines.append(f"| `{name}` | `{_default_repr(value)}` | {field.description} |")
    return "\n".join(lines) + "\n"
