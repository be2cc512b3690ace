"""The storage-node cluster as a pool tier. Reads and prefix lookups go to the nodes
synchronously (one batched request per node, in parallel); a pool puts through a WriteBehind
above this tier, so an engine's save never waits on the network. Any node fault is a miss
(see ClusterClient).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool.cluster.membership import Membership
from kvpool.config import ClusterConfig
from kvpool.keys import Namespace
from kvpool.net.client import ClusterClient
from kvpool.tiers.base import Item


class RemoteTier:
    name: str = "remote"
    label: str = "remote"
    stats_key: tuple[str, ...] = ("remote", "client")

    def __init__(self, cfg: ClusterConfig, membership: Membership | None = None) -> None:
        self.client = ClusterClient(cfg, membership)

    def register_namespace(self, ns: Namespace) -> None:
        """Raises AuthError if the nodes refuse this client's token for the namespace."""
        self.client.register_namespace(ns)

    def contains_many(self, keys: Sequence[bytes], namespace_id: bytes) -> list[bool]:
        return [False] * len(keys)  # only the nodes know: see lookup

    def lookup(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        return self.client.exists_prefix(ns, keys)

    def get_many_into(self, ns: Namespace, keys: Sequence[bytes],
                      outs: Sequence[memoryview]) -> list[bool]:
        return self.client.get_many_into(ns, keys, outs)

    def put_many(self, items: Sequence[Item]) -> list[bool]:
        """Sends now, waiting for the nodes; True per chunk only if all of them were stored
        (ClusterClient counts chunks, not which)."""
        stored = self.client.put_many(items)
        return [stored >= len(items)] * len(items)

    def delete(self, key: bytes, ns: Namespace) -> bool:
        return self.client.delete(ns, [key]) > 0

    def invalidate(self, namespace_id: bytes, ns: Namespace | None) -> int:
        # Nodes need the namespace itself (its tenant is checked); an unknown id is a no-op.
        return self.client.invalidate(ns) if ns is not None else 0

    def touch_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [False] * len(keys)  # nodes learn recency from reads and replica touches

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def stats(self) -> dict[str, Any]:
        return self.client.stats()

    def close(self) -> None:
        self.client.close()
