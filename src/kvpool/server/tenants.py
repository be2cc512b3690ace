"""What a node counts per tenant, so STATS can answer a tenant with its own figures only.

Counted only with auth on, where every namespace a connection may declare belongs to one of
the configured tenants (so the table is bounded by the config). The figures are request
counters since the node started (requests, chunks and bytes stored and served, hits and
misses); the tiers do not track residency per tenant, so how much of a tenant's data is held
is not reported.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

COUNTERS = ("namespaces_declared", "requests", "put_chunks", "put_bytes", "get_hits",
            "get_misses", "get_bytes")


class TenantCounters:
    """Counters per tenant. Thread-safe (every connection's thread counts)."""

    def __init__(self, tenants: Iterable[str]) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, dict[str, int]] = {t: dict.fromkeys(COUNTERS, 0)
                                                   for t in tenants}

    def add(self, tenant: str, name: str, n: int = 1) -> None:
        """Count ``n`` under ``tenant``; a tenant outside the configured ones is ignored."""
        counts = self._counts.get(tenant)
        if counts is not None:
            with self._lock:
                counts[name] += n

    def snapshot(self, tenants: Iterable[str],
                 connections: dict[str, int]) -> dict[str, dict[str, int]]:
        """A copy of the named tenants' counters, with their open connections."""
        with self._lock:
            return {t: {"connections": connections.get(t, 0), **self._counts[t]}
                    for t in sorted(tenants) if t in self._counts}
