"""Admission policies: which DRAM victims are worth an SSD write."""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from kvpool.policy.base import Key


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
