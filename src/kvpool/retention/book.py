"""The retention book: what each save asked to be kept for (spec.py), per chunk key.

It answers the eviction wrapper (policy.py: which victims to skip, which come first), the
pool (which chunks to keep out of the lower tiers, which reads are misses because their TTL
passed, what ``release(session)`` ends) and the stats. Plain saves leave no entry, so a pool
whose callers never ask for retention pays a dict lookup per eviction candidate.

Pinned bytes are bounded: ``apply`` raises PinLimitError, and records nothing, when the pins
of one call would take the pinned bytes past ``max_pinned_bytes``.

Thread-safe (one lock; callers may hold a tier's lock when they call in, never the reverse).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.errors import PinLimitError
from kvpool.keys import Namespace
from kvpool.retention.spec import Priority, Retention


@dataclass(slots=True)
class _Meta:
    ns: Namespace
    priority: Priority
    until: float | None
    expires_at: float | None
    sessions: set[str] = field(default_factory=set)
    #: Saved at least once without a session: no release ends its retention.
    anchored: bool = False
    pinned_bytes: int = 0


class RetentionBook:
    """``now`` is the wall clock (tests pass their own)."""

    def __init__(self, max_pinned_bytes: int, now: Callable[[], float] = time.time) -> None:
        self.max_pinned_bytes = max_pinned_bytes
        self.now = now
        self._lock = threading.Lock()
        #: Per chunk key, what its saves asked for (read without the lock by the tiers'
        #: fast paths: an empty dict means nothing to honour).
        self.entries: dict[bytes, _Meta] = {}
        self._sessions: dict[str, set[bytes]] = {}
        self._deadlines: list[tuple[float, bytes]] = []
        #: Keys whose TTL passed, not yet removed from every tier (reads miss them).
        self._expired: dict[bytes, Namespace] = {}
        self._pinned_bytes = 0
        self._counts = dict.fromkeys(("pins_refused", "expired", "released"), 0)

    def __len__(self) -> int:
        return len(self.entries)

    # ------------------------------------------------------------------ saves
    def apply(self, ns: Namespace, keys: Sequence[bytes], retention: Retention) -> None:
        """Record ``retention`` for ``keys`` (saved or about to be). A key's retention only
        grows with later saves: the higher priority, the later deadlines, every session; a
        save with no TTL clears the TTL (the chunk is wanted for ever again). Raises
        PinLimitError (nothing recorded) when the pins would pass ``max_pinned_bytes``."""
        if retention.is_default and not any(k in self.entries for k in keys):
            return
        with self._lock:
            now = self.now()
            self._tick_locked(now)
            if retention.priority is Priority.PIN and not _passed(retention.until, now):
                new = sum(ns.chunk_bytes for k in set(keys) if not self._pinned(k))
                if new and self._pinned_bytes + new > self.max_pinned_bytes:
                    self._counts["pins_refused"] += 1
                    raise PinLimitError(
                        f"pinning {new} more bytes would hold {self._pinned_bytes + new} of "
                        f"at most {self.max_pinned_bytes} pinned bytes (pool."
                        f"max_pinned_fraction of dram.capacity); release a session, let pins "
                        f"expire, or save with priority 'high'")
            for key in keys:
                self._apply_locked(ns, key, retention)

    def _pinned(self, key: bytes) -> bool:
        meta = self.entries.get(key)
        return meta is not None and meta.pinned_bytes > 0

    def _apply_locked(self, ns: Namespace, key: bytes, r: Retention) -> None:
        meta = self.entries.get(key)
        if meta is None:
            if r.is_default:
                return
            meta = self.entries[key] = _Meta(ns, r.priority, r.until, r.expires_at)
        else:
            if r.priority > meta.priority:
                meta.priority, meta.until = r.priority, r.until
            elif r.priority == meta.priority:
                meta.until = None if meta.until is None or r.until is None \
                    else max(meta.until, r.until)
            meta.expires_at = None if r.expires_at is None or meta.expires_at is None \
                else max(meta.expires_at, r.expires_at)
        self._expired.pop(key, None)
        if r.session is None:
            meta.anchored = True
        else:
            meta.sessions.add(r.session)
            self._sessions.setdefault(r.session, set()).add(key)
        if meta.priority is Priority.PIN and not meta.pinned_bytes:
            meta.pinned_bytes = ns.chunk_bytes
            self._pinned_bytes += ns.chunk_bytes
        for deadline in (meta.until, meta.expires_at):
            if deadline is not None:
                heapq.heappush(self._deadlines, (deadline, key))

    # ------------------------------------------------------------------ what evictions ask
    def rank(self, key: Any) -> Priority:
        """The priority a victim search sees now: a passed ``until`` is NORMAL (no lock: a
        dict read, called per candidate under the tier's lock)."""
        meta = self.entries.get(key)
        if meta is None:
            return Priority.NORMAL
        if meta.priority > Priority.NORMAL and _passed(meta.until, self.now()):
            return Priority.NORMAL
        return meta.priority

    def ephemeral(self, key: Any) -> bool:
        meta = self.entries.get(key)
        return meta is not None and meta.priority is Priority.EPHEMERAL

    def expired(self, key: Any) -> bool:
        """Whether the chunk's TTL passed (its reads are misses)."""
        if key in self._expired:
            return True
        meta = self.entries.get(key)
        return meta is not None and _passed(meta.expires_at, self.now())

    def expired_keys(self) -> list[bytes]:
        with self._lock:
            return list(self._expired)

    def expired_items(self) -> list[tuple[bytes, Namespace]]:
        with self._lock:
            return list(self._expired.items())

    @property
    def any_expired(self) -> bool:
        return bool(self._expired)

    def left_dram(self, key: bytes) -> None:
        """The DRAM tier dropped the chunk: forget retention that only DRAM honours (no TTL
        and no session to answer for below DRAM)."""
        meta = self.entries.get(key)
        if meta is not None and meta.expires_at is None and not meta.sessions:
            with self._lock:
                self._forget_locked(key)

    # ------------------------------------------------------------------ time and sessions
    def tick(self) -> list[tuple[bytes, Namespace]]:
        """Apply the deadlines passed since the last call: pins that end give their bytes
        back, chunks whose TTL passed move to the expired set. Returns those (for the pool to
        drop from DRAM at once). Costs a heap peek when nothing is due."""
        if not self._deadlines or self._deadlines[0][0] > self.now():
            return []
        with self._lock:
            return self._tick_locked(self.now())

    def _tick_locked(self, now: float) -> list[tuple[bytes, Namespace]]:
        due: list[tuple[bytes, Namespace]] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, key = heapq.heappop(self._deadlines)
            meta = self.entries.get(key)
            if meta is None:
                continue
            if meta.pinned_bytes and _passed(meta.until, now):
                self._pinned_bytes -= meta.pinned_bytes
                meta.pinned_bytes = 0
            if _passed(meta.expires_at, now):
                self._forget_locked(key)
                self._expired[key] = meta.ns
                self._counts["expired"] += 1
                due.append((key, meta.ns))
        return due

    def done_expiring(self, keys: Sequence[bytes]) -> None:
        """The pool removed these expired chunks from every tier."""
        with self._lock:
            for key in keys:
                self._expired.pop(key, None)

    def release(self, session: str) -> list[tuple[bytes, Namespace]]:
        """End ``session``: its chunks that no other session and no session-less save holds
        lose their retention (pins give their bytes back). Returns those chunks (the ones
        ``release(session, delete=True)`` deletes)."""
        with self._lock:
            keys = self._sessions.pop(session, set())
            freed: list[tuple[bytes, Namespace]] = []
            for key in keys:
                meta = self.entries.get(key)
                if meta is None:
                    continue
                meta.sessions.discard(session)
                if not meta.sessions and not meta.anchored:
                    freed.append((key, meta.ns))
                    self._forget_locked(key)
            self._counts["released"] += len(freed)
            return freed

    def forget(self, keys: Sequence[bytes]) -> None:
        """The chunks were deleted: drop what the book holds for them."""
        if not self.entries and not self._expired:
            return
        with self._lock:
            for key in keys:
                self._forget_locked(key)
                self._expired.pop(key, None)

    def forget_namespace(self, ns_id: bytes) -> None:
        with self._lock:
            for key in [k for k, m in self.entries.items() if m.ns.id == ns_id]:
                self._forget_locked(key)
            for key in [k for k, ns in self._expired.items() if ns.id == ns_id]:
                del self._expired[key]

    def _forget_locked(self, key: bytes) -> None:
        meta = self.entries.pop(key, None)
        if meta is None:
            return
        self._pinned_bytes -= meta.pinned_bytes
        for session in meta.sessions:
            keys = self._sessions.get(session)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._sessions[session]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            by_priority = dict.fromkeys((p.name.lower() for p in Priority), 0)
            for meta in self.entries.values():
                by_priority[meta.priority.name.lower()] += 1
            return {"pinned_bytes": self._pinned_bytes,
                    "max_pinned_bytes": self.max_pinned_bytes,
                    "sessions": len(self._sessions), "expired_pending": len(self._expired),
                    **{f"{name}_chunks": n for name, n in by_priority.items()},
                    **self._counts}


def _passed(deadline: float | None, now: float) -> bool:
    return deadline is not None and deadline <= now
