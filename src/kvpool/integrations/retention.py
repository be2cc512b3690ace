"""Retention for the engine integrations (docs/retention.md): per engine from their settings
(``retention`` in vLLM's kv_connector_extra_config, SGLang's HiCache extra config, HF's
PrefixCache), per request from the request (vLLM's ``kv_transfer_params["retention"]``, the
HF calls' ``retention=``), the request's keys over the engine's. Imports no engine.

Failure contract: a save never fails inference. A request's malformed retention is logged and
ignored (the engine's applies); pins past ``pool.max_pinned_fraction`` are refused by the pool
(PinLimitError): logged as a warning (rate-limited) and counted, and the chunks are saved
without the pin, never dropped silently.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kvpool.errors import ArgumentError, PinLimitError
from kvpool.keys import Namespace
from kvpool.logs import RateLimited
from kvpool.retention import Retention

log = logging.getLogger("kvpool.integrations")
_said = RateLimited()


def merged_retention(engine: Mapping[str, Any] | None,
                     request: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The request's retention keys over the engine's; None when neither names any. A
    request's mapping that does not parse is logged and left out."""
    if request is not None:
        try:
            Retention.from_mapping(request)
        except ArgumentError as exc:
            log.warning("kvpool: ignoring the request's retention %r: %s", request, exc)
            request = None
    merged = {**(engine or {}), **(request or {})}
    return merged or None


def retention_now(params: Mapping[str, Any] | None) -> Retention | None:
    """The Retention of ``params`` for a save happening now (``ttl_s`` and ``pin_s`` count
    from now); None for none. Parameters checked before (settings, merged_retention)."""
    return Retention.from_mapping(params) if params else None


def retain_for_save(store: Any, ns: Namespace, keys: Sequence[bytes],
                    retention: Retention | None) -> bool:
    """Record ``retention`` for a save of ``keys`` on ``store`` (a KVPool; a store without
    ``retain`` ignores it). False when the pins were refused (logged, rate-limited): the save
    goes on without them."""
    retain = getattr(store, "retain", None)
    if retention is None or retain is None or not keys:
        return True
    try:
        retain(ns, keys, retention)
    except PinLimitError as exc:
        held = _said.due()
        if held is not None:
            log.warning("kvpool: pin refused, chunks saved unpinned: %s%s", exc,
                        f" ({held} more since the last report)" if held else "")
        return False
    return True


def check_retention(value: object) -> object:
    """Pydantic validator of a ``retention`` setting: a mapping that parses (ValueError)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError("must be a mapping such as {priority: high, ttl_s: 3600}")
    try:
        Retention.from_mapping(value)
    except ArgumentError as exc:
        raise ValueError(str(exc)) from None
    return dict(value)
