"""The SSD engine as a pool tier. ``put_many`` writes synchronously (in durable mode: written
and fdatasync-ed); a pool that must not wait puts through a WriteBehind above this tier.

Failure contract: an IO error while writing (a full or failing disk) is logged and counted as
``write_errors``; the chunks of the failed part are False. Reads follow SsdEngine's contract.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvpool.counters import Counters
from kvpool.keys import Namespace
from kvpool.ssd.engine import SsdEngine
from kvpool.tiers.base import Item, local_lookup

log = logging.getLogger("kvpool.ssd")


class SsdTier:
    name: str = "ssd"
    label: str = "ssd"
    stats_key: tuple[str, ...] = ("ssd",)

    def __init__(self, engine: SsdEngine) -> None:
        self.engine = engine
        self._counters = Counters("write_errors")  # put_many runs on several threads

    def register_namespace(self, ns: Namespace) -> None:
        if ns.chunk_bytes > self.engine.max_payload:
            raise ValueError(f"chunk of {ns.chunk_bytes} bytes does not fit ssd.segment_size="
                             f"{self.engine.segment_size}")

    def contains_many(self, keys: Sequence[bytes], namespace_id: bytes) -> list[bool]:
        return self.engine.contains_many(keys, namespace_id)

    def lookup(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        return local_lookup(self.engine.contains_many, keys, ns.id)

    def get_many_into(self, ns: Namespace, keys: Sequence[bytes],
                      outs: Sequence[memoryview]) -> list[bool]:
        return self.engine.get_many_into(keys, outs, namespace_id=ns.id)

    def put_many(self, items: Sequence[Item]) -> list[bool]:
        """Append the chunks the engine does not hold yet (one sync per segment touched, in
        durable mode). Per chunk: True once it is on the SSD. Sub-batches written before an
        IO error are indexed: the index, not the exception, says which chunks landed."""
        engine = self.engine
        todo = [item for item in items if not engine.contains(item[0], item[1].id)]
        if todo:
            try:
                engine.put_many(todo)
            except OSError as exc:
                log.warning("ssd write of %d chunks failed: %s", len(todo), exc)
                self._counters.add("write_errors")
        return [engine.contains(key, ns.id) for key, ns, _ in items]

    def delete(self, key: bytes, ns: Namespace) -> bool:
        return self.engine.delete(key)

    def invalidate(self, namespace_id: bytes, ns: Namespace | None) -> int:
        return self.engine.invalidate(namespace_id)

    def touch_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [self.engine.touch(key) for key in keys]

    def flush(self, timeout: float | None = None) -> bool:
        return True  # writes are synchronous

    def stats(self) -> dict[str, Any]:
        return {**self.engine.stats(), **self._counters.snapshot()}

    def close(self) -> None:
        self.engine.close()
