"""The node's namespace registry: bounded, so declares cannot grow a node without limit.

Every NAMESPACE a connection declares takes a reference here; the connection gives it back
when it closes or re-AUTHs. A namespace nobody references stays registered (clients declare
the same few namespaces again and again) on a least-recently-released list; once the registry
holds ``server.max_namespaces`` namespaces, declaring a new one forgets the oldest unused one
from the pool. Forgetting loses no data: chunks are filed under scoped keys, and the next
declare of that namespace serves them again. Only when every registered namespace is in use
is a new one refused (:class:`RegistryFull`).

What it holds is also what the node can say about its namespaces (``kvpool admin
invalidate --model``, a tenant's right to invalidate one by id): the ones declared since the
node started, up to ``server.max_namespaces``. Chunks on SSD of a namespace no client declared
since then are known by id only.

Thread-safe (every connection's thread declares and releases): one lock around each call.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from kvpool.keys import Namespace
from kvpool.pool import KVPool


class RegistryFull(Exception):
    """Every registered namespace is declared by some connection; a new one cannot fit."""


class NamespaceRegistry:
    def __init__(self, pool: KVPool, limit: int) -> None:
        self._pool = pool
        self._limit = limit
        self._refs: dict[bytes, int] = {}  # namespaces some connection declared
        self._in_use: dict[bytes, Namespace] = {}  # the same, by id
        self._unused: OrderedDict[bytes, Namespace] = OrderedDict()  # oldest released first
        self.forgotten = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._refs) + len(self._unused)

    def acquire(self, ns: Namespace) -> None:
        """Register ``ns`` with the pool (if it is not yet) and take a reference.

        Raises RegistryFull when the registry is at its limit with every namespace in use,
        and whatever ``KVPool.register_namespace`` raises (ValueError for a chunk size no
        tier can hold); nothing is taken then."""
        with self._lock:
            self._acquire(ns)

    def _acquire(self, ns: Namespace) -> None:
        if ns.id in self._refs:
            self._refs[ns.id] += 1
            return
        if self._unused.pop(ns.id, None) is not None:
            self._refs[ns.id] = 1
            self._in_use[ns.id] = ns
            return
        if len(self) >= self._limit:
            if not self._unused:
                raise RegistryFull(f"the node holds server.max_namespaces={self._limit} "
                                   "namespaces, all declared by open connections")
            _, oldest = self._unused.popitem(last=False)
            self._pool.unregister_namespace(oldest)
            self.forgotten += 1
        self._pool.register_namespace(ns)
        self._refs[ns.id] = 1
        self._in_use[ns.id] = ns

    def release(self, ns: Namespace) -> None:
        """Give back one reference taken by ``acquire``."""
        with self._lock:
            self._release(ns)

    def _release(self, ns: Namespace) -> None:
        refs = self._refs.get(ns.id)
        if refs is None:
            return
        if refs > 1:
            self._refs[ns.id] = refs - 1
            return
        del self._refs[ns.id]
        self._unused[ns.id] = self._in_use.pop(ns.id, ns)

    def find(self, ns_id: bytes) -> Namespace | None:
        """The registered namespace with this id, or None."""
        with self._lock:
            return self._in_use.get(ns_id) or self._unused.get(ns_id)

    def known(self) -> list[tuple[Namespace, bool]]:
        """Every registered namespace, with whether some connection declares it now."""
        with self._lock:
            return [*((ns, True) for ns in self._in_use.values()),
                    *((ns, False) for ns in self._unused.values())]

    def listing(self, tenants: frozenset[str] | None) -> list[dict[str, Any]]:
        """The registered namespaces as STATS shows them (all when ``tenants`` is None, else
        those of these tenants): id (hex), model, revision, tenant, chunk_bytes, in_use."""
        return [{"id": ns.id.hex(), "model": ns.model, "revision": ns.revision,
                 "tenant": ns.tenant, "chunk_bytes": ns.chunk_bytes, "in_use": in_use}
                for ns, in_use in self.known() if tenants is None or ns.tenant in tenants]

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"namespaces": len(self), "namespaces_in_use": len(self._refs),
                    "namespaces_limit": self._limit, "namespaces_forgotten": self.forgotten}
