"""What a tier calls when chunks enter or leave it (docs/routing.md, "KV events").

Tiers hold an ``events`` attribute that is None (no publisher: the default, and the cost is
one attribute test) or a TierEvents bound to the tier's medium. Every call must return at
once and never raise: a publisher queues the event, or drops it and counts the drop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvpool.keys import Namespace

#: The media kvpool publishes (vLLM's ``medium`` field).
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"
MEDIUM_REMOTE = "REMOTE"


class TierEvents(Protocol):
    """One tier's side of a publisher. ``namespace`` is the Namespace where the tier has it
    (its ``chunk_tokens`` becomes the event's ``block_size``), else the 16-byte id."""

    def stored(self, keys: Sequence[bytes], namespace: Namespace | bytes) -> None: ...

    def removed(self, keys: Sequence[bytes], namespace: Namespace | bytes) -> None: ...

    def cleared(self, namespace: Namespace | bytes) -> None: ...
