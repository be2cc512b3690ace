"""What a save asks to be kept for: a priority, deadlines and a session (docs/retention.md).

A :class:`Retention` travels with a save (per request), or is set per namespace as the
default of its saves; engines pass it as a plain mapping (vLLM's ``kv_transfer_params``,
the connectors' extra config), which :meth:`Retention.from_mapping` checks. Deadlines are
wall-clock seconds (``time.time()``), so they mean the same on every node.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpool.errors import ArgumentError


class Priority(enum.IntEnum):
    """Ordered from the first evicted to the last."""

    #: Kept in DRAM only: never written to the SSD nor sent to a storage node; evicted
    #: before any other chunk (reasoning tokens, one-off prompts).
    EPHEMERAL = 0
    #: The default: the eviction policy alone decides.
    NORMAL = 1
    #: Evicted only when no ephemeral or normal chunk of its size can be (until ``until``).
    HIGH = 2
    #: Never evicted until ``until`` passes or its session is released; bounded by
    #: ``pool.max_pinned_fraction`` (a pin over the bound raises PinLimitError).
    PIN = 3


_PRIORITIES = {p.name.lower(): p for p in Priority}
#: The keys :meth:`Retention.from_mapping` reads (others are the engine's and ignored).
MAPPING_KEYS = ("priority", "pin_until", "until", "pin_s", "ttl_s", "expires_at", "session")


@dataclass(frozen=True, slots=True)
class Retention:
    """``until``: when a PIN or HIGH save's protection ends (None: until its session is
    released, or for ever without one). ``expires_at``: after it the chunk is a miss on every
    read and evicted first (a fixed TTL; None: never). ``session``: names the saves that
    ``KVPool.release(session)`` ends (any string the caller picks: a conversation id)."""

    priority: Priority = Priority.NORMAL
    until: float | None = None
    expires_at: float | None = None
    session: str | None = field(default=None)

    def __post_init__(self) -> None:
        if not isinstance(self.priority, Priority):
            raise ArgumentError(f"priority must be a Priority, got {self.priority!r}")
        for name in ("until", "expires_at"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int | float)
                                      or isinstance(value, bool) or value != value):
                raise ArgumentError(f"retention {name} must be seconds since the epoch or "
                                    f"None, got {value!r}")
        if self.session is not None and (not isinstance(self.session, str) or not self.session
                                         or len(self.session.encode()) > 256):
            raise ArgumentError("retention session must be a non-empty string of at most "
                                f"256 bytes, got {self.session!r}")

    @property
    def is_default(self) -> bool:
        """A plain save: nothing for the retention book to remember."""
        return self == _DEFAULT

    @property
    def ephemeral(self) -> bool:
        return self.priority is Priority.EPHEMERAL

    @classmethod
    def from_mapping(cls, params: Mapping[str, Any] | None,
                     now: Callable[[], float] = time.time) -> Retention:
        """The retention named by an engine's parameters: ``priority`` (pin, high, normal,
        ephemeral), ``pin_until`` / ``until`` (epoch seconds) or ``pin_s`` (seconds from now),
        ``ttl_s`` (seconds from now) or ``expires_at`` (epoch seconds), ``session``. Other keys
        are ignored; None or {} is the default. Raises ArgumentError naming the bad key."""
        if not params:
            return _DEFAULT
        if not isinstance(params, Mapping):
            raise ArgumentError(f"retention parameters must be a mapping, got "
                                f"{type(params).__name__}")
        raw = params.get("priority", "normal")
        priority = _PRIORITIES.get(str(raw).lower()) if isinstance(raw, str) else None
        if priority is None:
            raise ArgumentError(f"retention priority must be one of {list(_PRIORITIES)}, "
                                f"got {raw!r}")
        until = _seconds(params, "pin_until") if "pin_until" in params \
            else _seconds(params, "until")
        if "pin_s" in params:
            until = now() + _positive(params, "pin_s")
        expires_at = _seconds(params, "expires_at")
        if "ttl_s" in params:
            expires_at = now() + _positive(params, "ttl_s")
        session = params.get("session")
        if session is not None and not isinstance(session, str):
            raise ArgumentError(f"retention session must be a string, got {session!r}")
        return cls(priority, until, expires_at, session)

    def to_mapping(self) -> dict[str, Any]:
        """The wire form (JSON-able); ``from_mapping`` reads it back."""
        out: dict[str, Any] = {"priority": self.priority.name.lower()}
        if self.until is not None:
            out["until"] = self.until
        if self.expires_at is not None:
            out["expires_at"] = self.expires_at
        if self.session is not None:
            out["session"] = self.session
        return out


def _seconds(params: Mapping[str, Any], name: str) -> float | None:
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise ArgumentError(f"retention {name} must be a number of seconds, got {value!r}")
    return float(value)


def _positive(params: Mapping[str, Any], name: str) -> float:
    value = _seconds(params, name)
    if value is None or value <= 0 or value == float("inf"):
        raise ArgumentError(f"retention {name} must be a finite number of seconds > 0, "
                            f"got {params.get(name)!r}")
    return value


_DEFAULT = Retention()
DEFAULT = _DEFAULT
