"""KVPool with a remote tier: two inference nodes (two pools, two cache dirs) share one real
storage node."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from kvtest import byte_namespace, payload_for, small_config
from node_process import NodeProcess

from kvpool.pool import KVPool

CHUNK = 64 * 1024


def remote_pool(tmp_path: Path, name: str, node: NodeProcess, **cluster: object) -> KVPool:
    return KVPool(small_config(tmp_path / name, cluster={"nodes": [node.address],
                                                         "retry_down_s": 0.2, **cluster}))


def test_kv_saved_on_one_pool_is_found_and_read_by_another(node: NodeProcess,
                                                          tmp_path: Path) -> None:
    ns = byte_namespace(CHUNK, salt="shared")
    keys = ns.chunk_keys(list(range(10)))  # 10 chunks of one token
    a = remote_pool(tmp_path, "a", node)
    a.register_namespace(ns)
    for key in keys[:6]:
        assert a.put(ns, key, payload_for(key, CHUNK))
    assert a.flush(10)
    b = remote_pool(tmp_path, "b", node)
    b.register_namespace(ns)
    assert b.lookup(ns, keys) == 6  # nothing local: one EXISTS to the node
    outs = [np.zeros(CHUNK, np.uint8) for _ in keys[:6]]
    assert b.get_many_into(ns, keys[:6], outs) == [True] * 6
    for key, out in zip(keys, outs, strict=False):
        assert np.array_equal(out, payload_for(key, CHUNK))
    assert b.flush(10)  # promotions run in the background, off the read's path
    stats = b.stats()["pool"]
    assert stats["remote_hits"] == 6 and stats["promotions"] == 6
    # Promoted into b's DRAM: the second read is local.
    assert b.get_many_into(ns, keys[:2], outs[:2]) == [True, True]
    assert b.stats()["pool"]["dram_hits"] == 2
    # Local prefix plus remote continuation: b holds 0-5 locally now, a stores 6-7 later.
    for key in keys[6:8]:
        a.put(ns, key, payload_for(key, CHUNK))
    a.flush(10)
    assert b.lookup(ns, keys) == 8
    a.close()
    b.close()


def test_a_dead_node_costs_misses_and_dropped_saves_never_errors(node: NodeProcess,
                                                                tmp_path: Path) -> None:
    ns = byte_namespace(CHUNK)
    pool = remote_pool(tmp_path, "p", node)
    pool.register_namespace(ns)
    keys = ns.chunk_keys(list(range(4)))
    node.kill9()
    for key in keys:  # saves still land locally; the cluster copy is dropped
        assert pool.put(ns, key, payload_for(key, CHUNK))
    assert pool.flush(10)
    other = remote_pool(tmp_path, "q", node)
    other.register_namespace(ns)  # no live node to check with: allowed, checked on first use
    assert other.lookup(ns, keys) == 0
    out = np.zeros(CHUNK, np.uint8)
    assert other.get_into(ns, keys[0], out) is False
    remote = pool.stats()["remote"]
    assert remote["write_behind"]["write_errors"] == 4
    assert remote["client"]["node_failures"] >= 1
    pool.close()
    other.close()


def test_asyncio_client_from_many_tasks(node: NodeProcess) -> None:
    import asyncio

    from kvpool.config import ClusterConfig
    from kvpool.net.aio import AsyncClusterClient

    ns = byte_namespace(CHUNK)
    keys = ns.chunk_keys(list(range(16)))

    async def main() -> list[list[bool]]:
        async with AsyncClusterClient(ClusterConfig(nodes=[node.address])) as client:
            await client.register_namespace(ns)
            assert await client.put_many((k, ns, payload_for(k, CHUNK)) for k in keys) == 16
            assert await client.exists_prefix(ns, keys) == 16
            outs = [np.zeros(CHUNK, np.uint8) for _ in keys]
            found = await asyncio.gather(*(client.get_many_into(ns, [k], [o])
                                           for k, o in zip(keys, outs, strict=True)))
            for key, out in zip(keys, outs, strict=True):
                assert np.array_equal(out, payload_for(key, CHUNK))
            assert await client.invalidate(ns) >= 16  # copies, summed over the node's tiers
            return found

    assert asyncio.run(main()) == [[True]] * 16
