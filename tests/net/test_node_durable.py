"""A durable storage node (``ssd.durability: durable``, write-through): a PUT's count is what
is on the node's SSD and synced, so a kill -9 right after the answer loses none of it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from kvtest import byte_namespace, payload_for
from node_process import NodeProcess

from kvpool.config import ClusterConfig
from kvpool.net.client import ClusterClient

CHUNK = 64 * 1024


def test_acknowledged_puts_survive_kill_9_of_a_durable_node(tmp_path: Path) -> None:
    node = NodeProcess(tmp_path / "node", ssd={"durability": "durable"})
    node.start()
    ns = byte_namespace(CHUNK, salt="durable")
    acked: list[bytes] = []
    try:
        for _round in range(3):
            client = ClusterClient(ClusterConfig(nodes=[node.address]))
            client.register_namespace(ns)
            for _batch in range(20):
                keys = [os.urandom(16) for _ in range(8)]
                assert client.put_many([(k, ns, payload_for(k, CHUNK)) for k in keys]) == 8
                acked += keys
            client.close()
            node.kill9()  # right after the last answer: nothing gets a chance to drain
            node.start()
        client = ClusterClient(ClusterConfig(nodes=[node.address]))
        client.register_namespace(ns)
        outs = [np.zeros(CHUNK, np.uint8) for _ in acked]
        found = client.get_many_into(ns, acked, outs)
        client.close()
        lost = [k for k, hit, out in zip(acked, found, outs, strict=True)
                if not hit or not np.array_equal(out, payload_for(k, CHUNK))]
        assert not lost, f"{len(lost)} of {len(acked)} acknowledged chunks lost"
    finally:
        node.stop()
