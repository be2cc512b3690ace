"""Admission policies: which DRAM victims are worth an SSD write."""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from kvpool.policy.base import Key
from kvpool.policy.sketch import FrequencySketch


class AdmissionPolicy(Protocol):
    def admit(self, key: Key, hits: int) -> bool:
        """True if the chunk should be written to the slower tier. ``hits`` counts reads of
        the chunk while it was in DRAM."""
        ...


class AlwaysAdmit:
    def admit(self, key: Key, hits: int) -> bool:
        return True


class SecondUseAdmission:
    """Admit a chunk on its second use: it was read while in DRAM, or it was offered before
    (within the last ``window`` distinct offers). Saves SSD writes on one-hit prefixes."""

    def __init__(self, window: int = 65536) -> None:
        self._seen: OrderedDict[Key, None] = OrderedDict()
        self._window = window

    def admit(self, key: Key, hits: int) -> bool:
        if hits > 0:
            return True
        if key in self._seen:
            del self._seen[key]
            return True
        self._seen[key] = None
        if len(self._seen) > self._window:
            self._seen.popitem(last=False)
        return False


class HitAdmission:
    """Admit only a chunk read while in DRAM (``hits > 0``): a chunk evicted unread was, on
    the traces, mostly never requested again. Stateless."""

    def admit(self, key: Key, hits: int) -> bool:
        return hits > 0


class FrequencyAdmission:
    """Admit a chunk read while in DRAM, or offered before (DRAM evicted it unread, it was
    put again and is evicted again): ``SecondUseAdmission`` with a count-min sketch
    (``sketch.FrequencySketch``, counters halved as they age) in place of an exact window,
    so its memory is a fixed ``4 * width`` bytes whatever the key count. A hash collision
    can admit a chunk seen once (never the reverse)."""

    def __init__(self, width: int = 1 << 16) -> None:
        self._sketch = FrequencySketch(width)

    def admit(self, key: Key, hits: int) -> bool:
        if hits > 0:
            return True
        seen = self._sketch.estimate(key) > 0
        self._sketch.increment(key)
        return seen
