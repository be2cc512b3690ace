"""Per-tenant byte quotas of DRAM and SSD (``pool.tenant_quotas``), enforced by the tiers.

A namespace belongs to the tenant named before the first ':' of its tenant_salt (keys.py).
DRAM: a tenant whose resident bytes would pass its quota evicts its own chunks for the new
one, never another tenant's, and drops the save when none of its own can go (counted as
``quota_drops``). SSD: a save of a tenant at its SSD quota first removes the tenant's oldest
SSD chunks (as this pool wrote them; ones the SSD's own log eviction dropped meanwhile are
still counted until then, so the figure errs high, never low); a tenant without a quota is
unbounded. Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from kvpool.keys import Namespace


class TenantQuotas:
    """``limits``: tenant -> {"dram_bytes": int | None, "ssd_bytes": int | None}."""

    def __init__(self, limits: Mapping[str, Mapping[str, int | None]]) -> None:
        self._dram = {t: q["dram_bytes"] for t, q in limits.items()
                      if q.get("dram_bytes") is not None}
        self._ssd = {t: q["ssd_bytes"] for t, q in limits.items()
                     if q.get("ssd_bytes") is not None}
        self._lock = threading.Lock()
        self._dram_used: dict[str, int] = {}
        self._ssd_used: dict[str, int] = {}
        self._ssd_keys: dict[str, OrderedDict[bytes, tuple[Namespace, int]]] = {}
        self._counts: dict[str, dict[str, int]] = {}

    @property
    def enabled(self) -> bool:
        return bool(self._dram or self._ssd)

    @property
    def limits_ssd(self) -> bool:
        return bool(self._ssd)

    def _count(self, tenant: str, name: str, n: int = 1) -> None:
        counts = self._counts.setdefault(tenant, {})
        counts[name] = counts.get(name, 0) + n

    # ------------------------------------------------------------------ DRAM
    def dram_full(self, tenant: str, nbytes: int) -> bool:
        """Would ``nbytes`` more take ``tenant`` past its DRAM quota?"""
        limit = self._dram.get(tenant)
        return limit is not None and self._dram_used.get(tenant, 0) + nbytes > limit

    def charge_dram(self, tenant: str, nbytes: int) -> None:
        """``nbytes`` (negative: given back) of DRAM now held by ``tenant``."""
        with self._lock:
            self._dram_used[tenant] = self._dram_used.get(tenant, 0) + nbytes

    def dropped(self, tenant: str) -> None:
        with self._lock:
            self._count(tenant, "quota_drops")

    # ------------------------------------------------------------------ SSD
    def make_ssd_room(self, ns: Namespace, key: bytes,
                      nbytes: int) -> list[tuple[bytes, Namespace]]:
        """Note a chunk of ``ns`` written to the SSD; returns the tenant's oldest chunks to
        delete from it so the tenant stays within its SSD quota (none without a quota)."""
        tenant = ns.tenant
        limit = self._ssd.get(tenant)
        if limit is None:
            return []
        with self._lock:
            keys = self._ssd_keys.setdefault(tenant, OrderedDict())
            if key in keys:
                return []
            keys[key] = (ns, nbytes)
            used = self._ssd_used.get(tenant, 0) + nbytes
            out = []
            while used > limit and len(keys) > 1:
                old, (old_ns, old_bytes) = keys.popitem(last=False)
                used -= old_bytes
                out.append((old, old_ns))
            self._ssd_used[tenant] = used
            if out:
                self._count(tenant, "ssd_quota_evictions", len(out))
            return out

    def forget_ssd(self, ns: Namespace, key: bytes) -> None:
        keys = self._ssd_keys.get(ns.tenant)
        if keys is None:
            return
        with self._lock:
            found = keys.pop(key, None)
            if found is not None:
                self._ssd_used[ns.tenant] -= found[1]

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per tenant with a quota or bytes held: used and quota bytes per tier, drops."""
        with self._lock:
            tenants = set(self._dram) | set(self._ssd) | set(self._dram_used)
            return {t: {"dram_bytes": self._dram_used.get(t, 0),
                        "dram_quota_bytes": self._dram.get(t),
                        "ssd_bytes": self._ssd_used.get(t, 0),
                        "ssd_quota_bytes": self._ssd.get(t),
                        "quota_drops": self._counts.get(t, {}).get("quota_drops", 0),
                        "ssd_quota_evictions":
                            self._counts.get(t, {}).get("ssd_quota_evictions", 0)}
                    for t in sorted(tenants)}
