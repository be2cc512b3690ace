"""What the router knows each engine holds in its own prefix cache, from vLLM's KV events.

Transport, sequence numbers, incarnations, replay of a gap and resets are
:class:`kvpool.events.consumer.EventConsumer`'s (the router is one of its listeners). This
module keeps the one thing the consumer cannot: an engine's cache in keys the router can
compute from a prompt. vLLM's block hashes depend on its hash seed and algorithm, so
:class:`EngineIndex` does not reproduce them: it rebuilds each stored block's key as kvpool's
chained key of the block's ``token_ids`` after its parent's key (the router's own namespace of
16 zero bytes), and maps vLLM's hash to it for the removals. A block whose parent it never
saw (events lost before it subscribed) is skipped: a miss, never a false hit.

:class:`SourceStats` is the per-publisher bookkeeping behind the router's metrics (lag,
delay, resets by reason).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.events.schema import AllBlocksCleared, BlockRemoved, BlockStored
from kvpool.keys import KEY_BYTES, chunk_keys, next_chunk_key

#: The router's own namespace for engine-cache keys (engine block hashes are per engine).
ENGINE_NAMESPACE = bytes(KEY_BYTES)

RESET_CLEARED = "cleared"  # AllBlocksCleared
RESET_DEAD = "dead"  # the router found the engine down


@dataclass
class SourceStats:
    """One publisher as the router's metrics see it."""

    name: str
    batches: int = 0
    last_event_ts: float = 0.0  # the publisher's timestamp of the last batch applied
    last_applied: float = 0.0  # local time.time() of the last batch applied
    delay_s: float = 0.0  # last_applied - last_event_ts: how late the last batch arrived
    resets: dict[str, int] = field(default_factory=dict)

    def applied(self, ts: float) -> None:
        self.batches += 1
        self.last_event_ts = ts
        self.last_applied = time.time()
        self.delay_s = max(0.0, self.last_applied - ts)

    def lag_s(self) -> float:
        """Seconds since the last batch applied (0 before the first)."""
        return max(0.0, time.time() - self.last_applied) if self.last_applied else 0.0


class EngineIndex:
    """An engine's prefix cache, from vLLM's KV events (see the module docstring)."""

    def __init__(self) -> None:
        self.block_size = 0  # tokens per block, from the first BlockStored
        self._keys: dict[Hashable, bytes] = {}  # vLLM block hash -> router key
        self._held: dict[bytes, int] = {}  # router key -> vLLM hashes naming it

    def clear(self) -> None:
        self._keys.clear()
        self._held.clear()

    def __len__(self) -> int:
        return len(self._held)

    def apply(self, events: Sequence[Any]) -> bool:
        """Apply one batch's events in order; returns whether one was ``AllBlocksCleared``
        (the index was emptied)."""
        cleared = False
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                self.clear()
                cleared = True
            elif isinstance(ev, BlockStored):
                self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    self._removed(h)
        return cleared

    def _removed(self, h: Any) -> None:
        key = self._keys.pop(_hashable(h), None)
        if key is None:
            return
        left = self._held.get(key, 1) - 1
        if left > 0:
            self._held[key] = left
        else:
            self._held.pop(key, None)

    def _stored(self, ev: BlockStored) -> None:
        size, hashes, tokens = ev.block_size, ev.block_hashes, ev.token_ids
        if size <= 0 or len(tokens) != size * len(hashes):
            return  # not a shape this index can key: a miss later, never a false hit
        if self.block_size != size:
            self.clear()  # another block size: keys of the old one never match again
            self.block_size = size
        prev: bytes | None = None
        if ev.parent_block_hash is not None:
            prev = self._keys.get(_hashable(ev.parent_block_hash))
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


def _hashable(h: Any) -> Hashable:
    """A block hash as a dict key (vLLM's are bytes or ints; a list would not hash)."""
    return tuple(h) if isinstance(h, list) else h
