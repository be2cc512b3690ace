"""What the router knows each engine and pool holds, learned from KV events.

Two kinds of source, one :class:`SourceState` each (sequence numbers, incarnation):

- :class:`EngineIndex`: an engine's own prefix cache, from vLLM's ``BlockStored`` /
  ``BlockRemoved`` / ``AllBlocksCleared``. vLLM's block hashes depend on its hash seed and
  algorithm, so the index does not reproduce them: it rebuilds each stored block's key as
  kvpool's chained key of the block's ``token_ids`` after its parent's key (the router's own
  namespace of 16 zero bytes), and maps vLLM's hash to it for the removals. A block whose
  parent it never saw (events lost before it subscribed) is skipped: a miss, never a false hit.
- :class:`PoolIndex`: a kvpool host pool or storage node, whose events carry kvpool's chunk
  keys (docs/routing.md, section 1) with a medium (``CPU``, ``DISK``).

Staleness (the complaint about every router): a batch whose ``seq`` is not the last + 1 (a
gap: events lost), a ``seq`` that goes back (the publisher restarted: vLLM's counter starts
at 0) or a new ``incarnation`` (kvpool's publishers) drops everything the index knew of that
source, and it starts again from that batch. Replay is not asked for: a reset costs hits for a
while, never correctness.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.keys import KEY_BYTES, chunk_keys, next_chunk_key

#: The router's own namespace for engine-cache keys (engine block hashes are per engine).
ENGINE_NAMESPACE = bytes(KEY_BYTES)

RESET_GAP = "gap"
RESET_RESTART = "restart"  # seq went back or a new incarnation
RESET_CLEARED = "cleared"  # AllBlocksCleared
RESET_DEAD = "dead"  # the router found the engine down


@dataclass
class SourceState:
    """Sequence bookkeeping of one publisher. ``on_reset(reason)`` is called on every reset."""

    name: str
    on_reset: Callable[[str], None] | None = None
    last_seq: int | None = None
    incarnation: str | None = None
    last_event_ts: float = 0.0  # the publisher's timestamp of the last batch applied
    last_applied: float = 0.0  # local time.time() of the last batch applied
    delay_s: float = 0.0  # last_applied - last_event_ts: how late the last batch arrived
    resets: dict[str, int] = field(default_factory=dict)

    def admit(self, seq: int, incarnation: str | None) -> str | None:
        """Whether a batch continues what the index holds: None if so, else the reason to
        reset first (the batch is then applied to an empty index)."""
        reason = None
        if self.last_seq is not None:
            restarted = incarnation is not None and incarnation != self.incarnation
            if restarted or seq <= self.last_seq:
                reason = RESET_RESTART
            elif seq != self.last_seq + 1:
                reason = RESET_GAP
        self.last_seq = seq
        self.incarnation = incarnation
        return reason

    def count_reset(self, reason: str) -> None:
        self.resets[reason] = self.resets.get(reason, 0) + 1
        if self.on_reset is not None:
            self.on_reset(reason)


def decode_batch(payload: Any) -> tuple[float, list[dict[str, Any]], str | None, str | None]:
    """A decoded ``KVEventBatch`` array: (ts, events, node, incarnation); kvpool's trailing
    node and incarnation are None from vLLM. Raises ValueError for another shape."""
    if not isinstance(payload, list | tuple) or len(payload) < 2:
        raise ValueError("not a KVEventBatch array")
    ts, events = payload[0], payload[1]
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise ValueError("not a KVEventBatch array")
    node = payload[3] if len(payload) > 3 and isinstance(payload[3], str) else None
    inc = payload[4] if len(payload) > 4 and isinstance(payload[4], str) else None
    return float(ts), [e for e in events if isinstance(e, dict)], node, inc


class _Index:
    """Shared bookkeeping: apply a batch after the sequence checks."""

    def __init__(self, name: str, on_reset: Callable[[str, str], None] | None = None) -> None:
        self.state = SourceState(name, None if on_reset is None
                                 else (lambda reason: on_reset(name, reason)))

    def clear(self) -> None:
        raise NotImplementedError

    def reset(self, reason: str) -> None:
        self.clear()
        self.state.count_reset(reason)

    def apply(self, seq: int, payload: Any) -> None:
        """One ZMQ message's batch. Raises ValueError for a payload that is no batch (the
        caller counts and drops it)."""
        ts, events, _node, inc = decode_batch(payload)
        reason = self.state.admit(seq, inc)
        if reason is not None:
            self.reset(reason)
        for ev in events:
            self._event(ev)
        self.state.last_event_ts = ts
        self.state.last_applied = time.time()
        self.state.delay_s = max(0.0, self.state.last_applied - ts)

    def _event(self, ev: dict[str, Any]) -> None:
        raise NotImplementedError

    def lag_s(self) -> float:
        """Seconds since the last batch applied (0 before the first)."""
        return max(0.0, time.time() - self.state.last_applied) if self.state.last_applied else 0.0


class EngineIndex(_Index):
    """An engine's prefix cache, from vLLM's KV events (see the module docstring)."""

    def __init__(self, name: str, on_reset: Callable[[str, str], None] | None = None) -> None:
        super().__init__(name, on_reset)
        self.block_size = 0  # tokens per block, from the first BlockStored
        self._keys: dict[Hashable, bytes] = {}  # vLLM block hash -> router key
        self._held: dict[bytes, int] = {}  # router key -> vLLM hashes naming it

    def clear(self) -> None:
        self._keys.clear()
        self._held.clear()

    def __len__(self) -> int:
        return len(self._held)

    def _event(self, ev: dict[str, Any]) -> None:
        kind = ev.get("type")
        if kind == "AllBlocksCleared":
            self.reset(RESET_CLEARED)
        elif kind == "BlockStored":
            self._stored(ev)
        elif kind == "BlockRemoved":
            for h in ev.get("block_hashes") or ():
                key = self._keys.pop(_hashable(h), None)
                if key is not None:
                    left = self._held.get(key, 1) - 1
                    if left > 0:
                        self._held[key] = left
                    else:
                        self._held.pop(key, None)

    def _stored(self, ev: dict[str, Any]) -> None:
        size = ev.get("block_size")
        hashes = ev.get("block_hashes") or []
        tokens = ev.get("token_ids") or []
        if not isinstance(size, int) or size <= 0 or len(tokens) != size * len(hashes):
            return  # not a shape this index can key: a miss later, never a false hit
        if self.block_size != size:
            self.clear()  # another block size: keys of the old one never match again
            self.block_size = size
        parent = ev.get("parent_block_hash")
        prev: bytes | None = None
        if parent is not None:
            prev = self._keys.get(_hashable(parent))
            if prev is None:
                return  # its prefix is unknown here
        for i, h in enumerate(hashes):
            try:
                prev = next_chunk_key(ENGINE_NAMESPACE, prev, tokens[i * size:(i + 1) * size])
            except (ValueError, OverflowError, TypeError):
                return
            hh = _hashable(h)
            if hh not in self._keys:
                self._keys[hh] = prev
                self._held[prev] = self._held.get(prev, 0) + 1

    def cached_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens of the prompt's leading blocks this engine holds (0 before any event)."""
        if not self.block_size or not self._held:
            return 0
        n = 0
        for key in chunk_keys(ENGINE_NAMESPACE, token_ids, self.block_size):
            if key not in self._held:
                break
            n += 1
        return n * self.block_size


class PoolIndex(_Index):
    """A kvpool host pool or storage node: its chunk keys, by medium (CPU, DISK)."""

    def __init__(self, name: str, on_reset: Callable[[str, str], None] | None = None) -> None:
        super().__init__(name, on_reset)
        self._media: dict[bytes, set[str]] = {}

    def clear(self) -> None:
        self._media.clear()

    def __len__(self) -> int:
        return len(self._media)

    def __contains__(self, key: bytes) -> bool:
        return key in self._media

    def _event(self, ev: dict[str, Any]) -> None:
        kind = ev.get("type")
        medium = str(ev.get("medium") or "")
        if kind == "AllBlocksCleared":
            if not medium:
                self.reset(RESET_CLEARED)
                return
            for key in [k for k, m in self._media.items() if medium in m]:
                self._drop(key, medium)
            self.state.count_reset(RESET_CLEARED)
        elif kind == "BlockStored":
            for h in ev.get("block_hashes") or ():
                if isinstance(h, bytes):
                    self._media.setdefault(h, set()).add(medium)
        elif kind == "BlockRemoved":
            for h in ev.get("block_hashes") or ():
                if isinstance(h, bytes):
                    self._drop(h, medium)

    def _drop(self, key: bytes, medium: str) -> None:
        media = self._media.get(key)
        if media is None:
            return
        media.discard(medium)
        if not media:
            del self._media[key]


def leading_run(keys: Sequence[bytes], indexes: Sequence[PoolIndex]) -> int:
    """How many of the leading ``keys`` at least one of ``indexes`` holds."""
    n = 0
    for key in keys:
        if not any(key in ix for ix in indexes):
            break
        n += 1
    return n


def _hashable(h: Any) -> Hashable:
    """A block hash as a dict key (vLLM's are bytes or ints; a list would not hash)."""
    return tuple(h) if isinstance(h, list) else h
