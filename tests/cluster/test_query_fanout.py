"""The cluster-wide query (issue 26, item 2): any node asked with ``"scope": "cluster"``
answers for every node of its etcd membership, in parallel; a node killed -9 is reported
dead (while its lease lives: it does not answer; after: it is expected but not registered),
never an error. Real etcd, two real ``kvpool serve`` processes."""

from __future__ import annotations

from pathlib import Path

from events_support import node_only_pool, post_json
from kvtest import byte_namespace, payload_for, wait_for
from node_process import NodeProcess

CHUNK = 64 * 1024


def test_a_cluster_query_fans_out_and_reports_a_dead_node(tmp_path: Path, etcd_endpoint: str,
                                                          cluster_name: str) -> None:
    cluster = {"etcd": [etcd_endpoint], "name": cluster_name, "lease_ttl_s": 2.0}
    a, b = (NodeProcess(tmp_path / n, cluster=cluster, server={"node_id": n, "metrics_port": 0},
                        query={"timeout_s": 1.0})
            for n in ("node-a", "node-b"))
    ns = byte_namespace(CHUNK, salt="fanout")
    tokens = list(range(8))
    keys = ns.chunk_keys(tokens)
    clients = []
    try:
        a.start()
        b.start()
        assert a.metrics_port is not None
        for node, part in ((a, keys[:6]), (b, keys[:3])):  # a holds 6 chunks, b 3
            client = node_only_pool(tmp_path / node.address.replace(":", "_"), node)
            clients.append(client)
            client.register_namespace(ns)
            assert client.put_many(ns, part, [payload_for(k, CHUNK) for k in part]) == len(part)
            assert client.flush(30)
        ask = {"namespace_id": ns.id.hex(), "block_size": 1, "token_ids": tokens,
               "scope": "cluster"}

        def answer() -> dict[str, dict[str, object]]:
            code, body = post_json(a.metrics_port or 0, "/query", ask)
            assert code == 200, body
            nodes: dict[str, dict[str, object]] = body["default"]
            return nodes

        wait_for(lambda: set(answer()) == {"node-a", "node-b"}, 30, "both nodes in node-a's view")
        both = answer()
        assert {n: (v["status"], v["longest_matched"], v["DISK"]) for n, v in both.items()} == \
            {"node-a": ("ok", 6, 6), "node-b": ("ok", 3, 3)}

        b.kill9()
        dead = answer()  # whether b's lease still lives or not: reported dead, not an error
        assert dead["node-a"]["longest_matched"] == 6 and dead["node-a"]["status"] == "ok"
        assert dead["node-b"]["status"] == "dead" and dead["node-b"]["longest_matched"] == 0
        assert dead["node-b"]["error"]
        wait_for(lambda: "not registered" in str(answer()["node-b"].get("error")), 30,
                 "node-b's lease expired: expected but not registered")
    finally:
        for client in clients:
            client.close()
        a.stop()
        b.stop()
