"""The remote tier of a KVPool: the storage-node cluster behind its own write-behind queue.

Saves are staged (one copy) and sent to the nodes by a worker thread in batches, so an
engine's save never waits on the network; when staging is full the save is dropped and
counted. Reads and prefix lookups go to the nodes synchronously (one batched request per
node, in parallel). Any node fault is a miss (see ClusterClient).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool.cluster.membership import Membership
from kvpool.config import ClusterConfig
from kvpool.keys import Namespace
from kvpool.net.client import ClusterClient
from kvpool.writebehind import WriteBehind


class RemoteTier:
    def __init__(self, cfg: ClusterConfig, batch: int = 16,
                 membership: Membership | None = None) -> None:
        self.client = ClusterClient(cfg, membership)
        self._wb = WriteBehind(self.client, cfg.write_behind_bytes, batch, name="cluster")

    def register_namespace(self, ns: Namespace) -> None:
        """Raises AuthError if the nodes refuse this client's token for the namespace."""
        self.client.register_namespace(ns)

    def offer(self, key: bytes, ns: Namespace, data: Any) -> bool:
        return self._wb.offer(key, ns, data)

    def staged_get_into(self, key: bytes, out: memoryview,
                        namespace_id: bytes | None = None) -> bool:
        return self._wb.get_into(key, out, namespace_id)

    def staged(self, key: bytes, namespace_id: bytes | None = None) -> bool:
        return self._wb.contains(key, namespace_id)

    def staged_many(self, keys: Sequence[bytes], namespace_id: bytes) -> list[bool]:
        return self._wb.contains_many(keys, namespace_id)

    def lookup(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        return self.client.exists_prefix(ns, keys)

    def get_many_into(self, ns: Namespace, keys: Sequence[bytes],
                      outs: Sequence[memoryview]) -> list[bool]:
        return self.client.get_many_into(ns, keys, outs)

    def delete(self, ns: Namespace, key: bytes) -> bool:
        self._wb.discard(key)
        self._wb.flush()
        return self.client.delete(ns, [key]) > 0

    def invalidate(self, ns: Namespace) -> int:
        self._wb.discard_namespace(ns.id)
        self._wb.flush()
        return self.client.invalidate(ns)

    def flush(self, timeout: float | None = None) -> bool:
        return self._wb.flush(timeout)

    def stats(self) -> dict[str, Any]:
        return {"client": self.client.stats(), "write_behind": self._wb.stats()}

    def close(self) -> None:
        """Send what is staged (nodes that are down drop it), then close connections."""
        self._wb.close()
        self.client.close()
