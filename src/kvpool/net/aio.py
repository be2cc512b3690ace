"""asyncio face of the cluster client, for engines and services built on an event loop.

Each call runs the blocking ClusterClient call on a worker thread (``asyncio.to_thread``), so
the loop never blocks on a socket and calls from many tasks proceed in parallel over the
client's pooled connections. Same failure contract as ClusterClient: node faults are misses,
never exceptions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any

from kvpool.cluster.membership import Membership
from kvpool.config import ClusterConfig
from kvpool.keys import Namespace
from kvpool.net.client import ClusterClient


class AsyncClusterClient:
    """``async with AsyncClusterClient(cfg) as client: await client.get_many_into(...)``."""

    def __init__(self, cfg: ClusterConfig, membership: Membership | None = None) -> None:
        self.sync = ClusterClient(cfg, membership)

    async def register_namespace(self, ns: Namespace, replicas: int | None = None) -> None:
        await asyncio.to_thread(self.sync.register_namespace, ns, replicas)

    async def exists_prefix(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        return await asyncio.to_thread(self.sync.exists_prefix, ns, keys)

    async def get_many_into(self, ns: Namespace, keys: Sequence[bytes],
                            outs: Sequence[Any]) -> list[bool]:
        return await asyncio.to_thread(self.sync.get_many_into, ns, keys, outs)

    async def put_many(self, items: Iterable[tuple[bytes, Namespace, Any]]) -> int:
        return await asyncio.to_thread(self.sync.put_many, list(items))

    async def delete(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        return await asyncio.to_thread(self.sync.delete, ns, keys)

    async def invalidate(self, ns: Namespace) -> int:
        return await asyncio.to_thread(self.sync.invalidate, ns)

    async def close(self) -> None:
        await asyncio.to_thread(self.sync.close)

    async def __aenter__(self) -> AsyncClusterClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
