"""Which settings a running node applies when its config is reloaded (SIGHUP), and how.

A setting is live-reloadable once registered (``LiveSettings.register``): a reload writes its
new value into the running Config object in place (every part of the node reads its
settings from that object at use, so the next request sees it) and then calls the hooks
registered for it (e.g. re-configure logging, rebuild the token table). A changed setting
that is not registered keeps its running value and is reported as needing a restart.

Policy (which keys are live) is the node's (node.py registers them); this module is the
mechanism. It never raises for a valid new Config: a hook that fails is logged, its key gets
its running value back and is reported as needing a restart.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from kvpool.config import Config

log = logging.getLogger("kvpool.serve")

#: Called with the new value after it was written into the running config.
Hook = Callable[[Any], None]
#: Whether a change from the old to the new value can be applied live (e.g. a token list
#: may change, but turning auth on or off needs a restart).
Guard = Callable[[Any, Any], bool]


@dataclass
class ReloadResult:
    """Dotted keys whose value changed: applied live, or kept until a restart."""

    applied: list[str] = field(default_factory=list)
    restart_needed: list[str] = field(default_factory=list)


def flatten(config: BaseModel, prefix: str = "") -> dict[str, Any]:
    """``{"server.max_connections": 1024, "cache_dir": ..., ...}``: every setting of a
    config by its dotted key (a section's fields one level down; lists and dicts whole)."""
    out: dict[str, Any] = {}
    for name in type(config).model_fields:
        value = getattr(config, name)
        key = f"{prefix}{name}"
        if isinstance(value, BaseModel) and not prefix:
            out.update(flatten(value, f"{key}."))
        else:
            out[key] = value.model_dump() if isinstance(value, BaseModel) else value
    return out


class LiveSettings:
    """The registry of live-reloadable settings of one running Config."""

    def __init__(self) -> None:
        self._hooks: dict[str, list[Hook]] = {}
        self._guards: dict[str, Guard] = {}

    def register(self, key: str, hook: Hook | None = None, guard: Guard | None = None) -> None:
        """Make ``key`` (``section.field``) live: a reload writes it in place and calls
        ``hook`` (if any) with the new value; ``guard(old, new)`` False leaves that change
        for a restart. Registering a key the Config does not have is allowed (a setting
        another part adds later): it then never changes."""
        hooks = self._hooks.setdefault(key, [])
        if hook is not None:
            hooks.append(hook)
        if guard is not None:
            self._guards[key] = guard

    def is_live(self, key: str) -> bool:
        return key in self._hooks

    def apply(self, running: Config, new: Config) -> ReloadResult:
        """Write every changed live setting of ``new`` into ``running`` and run its hooks;
        list the rest as needing a restart (their running values stay)."""
        result = ReloadResult()
        old_values, new_values = flatten(running), flatten(new)
        changed = [k for k in new_values if old_values.get(k) != new_values[k]]
        touched: list[tuple[str, Any, Any]] = []  # key, new value, running value
        for key in changed:
            guard = self._guards.get(key)
            if not self.is_live(key) or "." not in key or \
                    (guard is not None and not guard(old_values.get(key), new_values[key])):
                result.restart_needed.append(key)
                continue
            value = _get(new, key)
            touched.append((key, value, _set(running, key, value)))
        for key, value, before in touched:
            try:
                for hook in self._hooks[key]:
                    hook(value)
            except Exception as exc:  # never let a reload take the node down
                log.warning("config reload: applying %s failed, keeping its running value: %s",
                            key, exc, extra={"event": "config_reload_failed", "key": key})
                _set(running, key, before)
                result.restart_needed.append(key)
                continue
            result.applied.append(key)
        return result


def _get(config: Config, key: str) -> Any:
    section, name = key.split(".", 1)
    return getattr(getattr(config, section), name)


def _set(config: Config, key: str, value: Any) -> Any:
    """Write ``value`` at ``key`` in place; returns the value it replaced. The new Config was
    validated as a whole: assigning field by field through pydantic would re-run cross-field
    rules on half-updated sections."""
    section, name = key.split(".", 1)
    target = getattr(config, section)
    before = getattr(target, name)
    object.__setattr__(target, name, value)
    return before
