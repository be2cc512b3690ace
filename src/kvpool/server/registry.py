"""The node's namespace registry: bounded, so declares cannot grow a node without limit.

Every NAMESPACE a connection declares takes a reference here; the connection gives it back
when it closes or re-AUTHs. A namespace nobody references stays registered (clients declare
the same few namespaces again and again) on a least-recently-released list; once the registry
holds ``server.max_namespaces`` namespaces, declaring a new one forgets the oldest unused one
from the pool. Forgetting loses no data: chunks are filed under scoped keys, and the next
declare of that namespace serves them again. Only when every registered namespace is in use
is a new one refused (:class:`RegistryFull`).

Used from the node's event-loop thread only.
"""

from __future__ import annotations

from collections import OrderedDict

from kvpool.keys import Namespace
from kvpool.pool import KVPool


class RegistryFull(Exception):
    """Every registered namespace is declared by some connection; a new one cannot fit."""


class NamespaceRegistry:
    def __init__(self, pool: KVPool, limit: int) -> None:
        self._pool = pool
        self._limit = limit
        self._refs: dict[bytes, int] = {}  # namespaces some connection declared
        self._unused: OrderedDict[bytes, Namespace] = OrderedDict()  # oldest released first
        self.forgotten = 0

    def __len__(self) -> int:
        return len(self._refs) + len(self._unused)

    def acquire(self, ns: Namespace) -> None:
        """Register ``ns`` with the pool (if it is not yet) and take a reference.

        Raises RegistryFull when the registry is at its limit with every namespace in use,
        and whatever ``KVPool.register_namespace`` raises (ValueError for a chunk size no
        tier can hold); nothing is taken then."""
        if ns.id in self._refs:
            self._refs[ns.id] += 1
            return
        if self._unused.pop(ns.id, None) is not None:
            self._refs[ns.id] = 1
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

    def release(self, ns: Namespace) -> None:
        """Give back one reference taken by ``acquire``."""
        refs = self._refs.get(ns.id)
        if refs is None:
            return
        if refs > 1:
            self._refs[ns.id] = refs - 1
            return
        del self._refs[ns.id]
        self._unused[ns.id] = ns

    def stats(self) -> dict[str, int]:
        return {"namespaces": len(self), "namespaces_in_use": len(self._refs),
                "namespaces_limit": self._limit, "namespaces_forgotten": self.forgotten}
