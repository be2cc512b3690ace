"""A storage node's ledger of the bytes it holds for requests in progress, and its limits.

Held: a GET answer's per-request buffers (chunks read from below DRAM) until the answer is
sent, and a PUT's reserved slots until its payload is committed or given up. Pinned DRAM
views of a GET are not held here: they cost no memory beyond the DRAM tier.

Policy (``server.max_held_bytes``, ``server.tenant_held_share``, set by the store): the
node holds at most ``limit`` bytes in all, one tenant at most ``tenant_limit`` of them, and
one tenant's PUTs at most ``put_limit`` (that share of the DRAM tier: a PUT that stalls must
not reserve all of DRAM). Nothing here waits: a take that does not fit returns nothing, and
the store answers BUSY (or, for a PUT, drops the chunks that do not fit). Thread-safe (the
connections' threads take and give).
"""

from __future__ import annotations

import threading

#: The derived node-wide limit is never below this.
MIN_DERIVED_BYTES = 256 << 20


def derived_limit(configured: int, dram_capacity: int) -> int:
    """``server.max_held_bytes``, or for 0 a quarter of the DRAM tier (the part of the host's
    memory ``kvpool serve``'s start check keeps free is about that), at least 256 MiB."""
    return configured if configured > 0 else max(MIN_DERIVED_BYTES, dram_capacity // 4)


class HeldBytes:
    """The ledger. ``put_limit`` None: a tenant's PUTs are bounded by ``tenant_limit`` only
    (no DRAM tier, or auth off: then ``tenant_limit`` is ``limit``)."""

    def __init__(self, limit: int, tenant_limit: int, put_limit: int | None) -> None:
        self.limit, self.tenant_limit, self.put_limit = limit, tenant_limit, put_limit
        self._lock = threading.Lock()
        self.held = 0
        self._tenants: dict[str, int] = {}
        self._puts: dict[str, int] = {}

    def take(self, tenant: str, units: int, unit: int, put: bool = False) -> int:
        """Take room for as many of ``units`` items of ``unit`` bytes as fit (a GET asks for
        all or nothing by checking the result); returns how many were taken (0: none)."""
        if units <= 0 or unit <= 0:
            return 0
        with self._lock:
            room = min(self.limit - self.held,
                       self.tenant_limit - self._tenants.get(tenant, 0))
            if put and self.put_limit is not None:
                room = min(room, self.put_limit - self._puts.get(tenant, 0))
            n = max(0, min(units, room // unit))
            if n:
                nbytes = n * unit
                self.held += nbytes
                self._tenants[tenant] = self._tenants.get(tenant, 0) + nbytes
                if put:
                    self._puts[tenant] = self._puts.get(tenant, 0) + nbytes
        return n

    def give(self, tenant: str, nbytes: int, put: bool = False) -> None:
        """Give back ``nbytes`` taken for ``tenant`` (a PUT's with ``put``)."""
        if nbytes <= 0:
            return
        with self._lock:
            self.held -= nbytes
            left = self._tenants.get(tenant, 0) - nbytes
            if left > 0:
                self._tenants[tenant] = left
            else:
                self._tenants.pop(tenant, None)
            if put:
                left = self._puts.get(tenant, 0) - nbytes
                if left > 0:
                    self._puts[tenant] = left
                else:
                    self._puts.pop(tenant, None)

    def describe(self, tenant: str) -> str:
        """Why a request of ``tenant`` did not fit (for the BUSY message)."""
        with self._lock:
            mine = self._tenants.get(tenant, 0)
            return (f"the node holds {self.held} of server.max_held_bytes={self.limit} bytes "
                    f"for requests in progress, tenant {tenant!r} {mine} of its "
                    f"{self.tenant_limit} (server.tenant_held_share)")
