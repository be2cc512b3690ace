"""KV events and the query API of a real ``kvpool serve`` (issue 26, items 1 and 2): a
consumer subscribed to the node sees chunks stored (CPU and DISK), evicted from DRAM,
deleted and cleared by a namespace invalidation; the query API answers the same prefix per
tier; a lost batch is replayed; a node killed -9 and restarted is a new incarnation."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

from events_support import follow, free_port, get_json, node_only_pool, post_json
from kvtest import byte_namespace, payload_for, wait_for
from node_process import NodeProcess

from kvpool.events.consumer import EventConsumer
from kvpool.events.schema import KEY_SCOPE_NAMESPACE, filed_keys
from kvpool.events.sink import MEDIUM_CPU, MEDIUM_DISK

CHUNK = 64 * 1024


def small_node(tmp_path: Path, **sections: object) -> NodeProcess:
    """DRAM of 16 chunks over an SSD written through; events sent every 20 ms."""
    return NodeProcess(tmp_path / "node", server={"metrics_port": 0, "node_id": "node-a"},
                       dram={"capacity": "1MiB", "slab_size": "1MiB", "prefault": "none"},
                       events={"batch_interval_s": 0.02, **sections.pop("events", {})},
                       **sections)


def held(consumer: EventConsumer, node: str, medium: str, ns_id: bytes) -> set[bytes]:
    consumer.poll(0.05)
    return consumer.held(node, medium, ns_id)


def test_a_consumer_sees_stored_evicted_deleted_and_cleared_chunks_and_the_query_api_agrees(
        tmp_path: Path) -> None:
    ns = byte_namespace(CHUNK, salt="events")
    keys = ns.chunk_keys(list(range(24)))  # one token a chunk: 24 chunks, DRAM holds 16
    node = small_node(tmp_path).start()
    assert node.metrics_port is not None
    consumer = follow(node)
    client = node_only_pool(tmp_path, node)
    try:
        client.register_namespace(ns)
        assert client.put_many(ns, keys, [payload_for(k, CHUNK) for k in keys]) == 24
        assert client.flush(30)
        filed = filed_keys(KEY_SCOPE_NAMESPACE, ns.id, keys)  # as a node files them
        wait_for(lambda: held(consumer, "node-a", MEDIUM_DISK, ns.id) == set(filed), 30,
                 "every chunk announced stored on DISK")
        cpu = held(consumer, "node-a", MEDIUM_CPU, ns.id)
        assert cpu < set(filed) and 0 < len(cpu) < 24  # some evicted from DRAM, announced
        assert consumer.prefix("node-a", MEDIUM_DISK, ns.id, keys) == 24
        info = get_json(node.metrics_port, "/events")
        assert info["node"] == "node-a" and info["published"] > 0 and info["dropped"] == 0
        assert info["key_scope"] == KEY_SCOPE_NAMESPACE

        # The query API answers from the tiers' indexes what the events said.
        code, answer = post_json(node.metrics_port, "/query", {
            "namespace_id": ns.id.hex(), "block_size": 1, "token_ids": list(range(24))})
        assert code == 200
        mine = answer["default"]["node-a"]
        assert mine["status"] == "ok" and mine["incarnation"] == info["incarnation"]
        assert (mine["longest_matched"], mine["DISK"], mine["CPU"]) == \
            (24, 24, consumer.prefix("node-a", MEDIUM_CPU, ns.id, keys))
        code, by_hash = post_json(node.metrics_port, "/query_by_hash", {
            "model": "test-model", "tenant_id": "t1",
            "seq_hashes": [k.hex() for k in keys[:10]] + [bytes(16).hex()] + [keys[11].hex()]})
        assert code == 200  # the model name resolves to the one namespace the node knows
        assert by_hash["t1"]["node-a"]["longest_matched"] == 10
        assert by_hash["t1"]["node-a"]["DISK"] == 10
        code, bad = post_json(node.metrics_port, "/query", {"namespace_id": "zz",
                                                            "token_ids": [1]})
        assert code == 400 and "hex" in bad["error"]
        code, bad = post_json(node.metrics_port, "/query", {"model": "other",
                                                            "token_ids": [1]})
        assert code == 400 and "matches 0 namespaces" in bad["error"]

        assert client.delete(ns, keys[0])
        wait_for(lambda: filed[0] not in held(consumer, "node-a", MEDIUM_DISK, ns.id), 30,
                 "the deleted chunk announced removed from DISK")
        assert filed[0] not in held(consumer, "node-a", MEDIUM_CPU, ns.id)
        assert filed[1] in held(consumer, "node-a", MEDIUM_DISK, ns.id)
        code, answer = post_json(node.metrics_port, "/query", {
            "namespace_id": ns.id.hex(), "block_size": 1, "token_ids": list(range(24))})
        assert answer["default"]["node-a"]["longest_matched"] == 0

        client.invalidate(ns)
        wait_for(lambda: not held(consumer, "node-a", MEDIUM_DISK, ns.id)
                 and not held(consumer, "node-a", MEDIUM_CPU, ns.id), 30,
                 "the invalidated namespace announced cleared on both media")
        with urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics") as page:
            text = page.read().decode()
        assert 'kvpool_events_published_total{medium="DISK"}' in text
        assert "kvpool_events_dropped_total 0.0" in text
    finally:
        client.close()
        consumer.close()
        node.stop()


def test_a_lost_batch_is_replayed_and_a_restarted_node_is_a_new_incarnation(
        tmp_path: Path) -> None:
    ns = byte_namespace(CHUNK, salt="replay")
    keys = ns.chunk_keys(list(range(16)))
    filed = filed_keys(KEY_SCOPE_NAMESPACE, ns.id, keys)
    ports = {"port": free_port(), "replay_port": free_port()}  # the same across the restart
    node = small_node(tmp_path, events=ports).start()
    assert node.metrics_port is not None
    resets: list[str] = []
    consumer = follow(node, on_reset=resets.append)
    client = node_only_pool(tmp_path, node)
    try:
        client.register_namespace(ns)

        def put(part: list[bytes]) -> None:
            assert client.put_many(ns, part, [payload_for(k, CHUNK) for k in part]) == len(part)
            assert client.flush(30)

        put(keys[:4])
        wait_for(lambda: held(consumer, "node-a", MEDIUM_DISK, ns.id) == set(filed[:4]), 30,
                 "the first chunks")
        state = consumer.nodes["node-a"]
        first = state.incarnation
        time.sleep(0.2)  # let the node send everything of the first put
        consumer.poll(0.1)
        lost = get_json(node.metrics_port, "/events")["next_seq"]
        consumer.skip_seqs.add(lost)  # as if the network lost that batch
        put(keys[4:8])
        wait_for(lambda: get_json(node.metrics_port, "/events")["next_seq"] > lost, 30,
                 "the batch that gets lost was sent")
        put(keys[8:12])  # the next batch shows the gap
        wait_for(lambda: held(consumer, "node-a", MEDIUM_DISK, ns.id) == set(filed[:12]), 30,
                 "the lost batch replayed")
        assert state.replayed >= 1 and state.resets == 0 and resets == []

        node.kill9()
        node.start()
        client.close()  # a fresh client: the old one marked the node down
        client = node_only_pool(tmp_path, node)
        client.register_namespace(ns)
        put(keys[12:16])
        # The consumer's subscription reconnects in the background: on a loaded machine the
        # restarted node's first batch can go out before it is back (PUB drops it). Later
        # batches (here: chunks of another namespace, once a second) show the new
        # incarnation, and its lost first batch comes back by replay.
        other = byte_namespace(CHUNK, salt="replay-other")
        client.register_namespace(other)
        nudges = iter(other.chunk_keys(list(range(1000))))
        last_nudge = time.monotonic()

        def new_incarnation_seen() -> bool:
            nonlocal last_nudge
            if consumer.poll(0.05) >= 0 and state.incarnation != first:
                return True
            if time.monotonic() - last_nudge > 1.0:
                key = next(nudges)
                client.put_many(other, [key], [payload_for(key, CHUNK)])
                last_nudge = time.monotonic()
            return False

        wait_for(new_incarnation_seen, 60, "the restarted node's incarnation")
        assert resets == ["node-a"]  # what the old incarnation held was dropped
        wait_for(lambda: held(consumer, "node-a", MEDIUM_DISK, ns.id) == set(filed[12:]), 30,
                 "only what the new incarnation announced")
        # What the node recovered from its SSD is not announced; the query API has it.
        code, answer = post_json(node.metrics_port, "/query", {
            "namespace_id": ns.id.hex(), "block_size": 1, "token_ids": list(range(16))})
        assert code == 200 and answer["default"]["node-a"]["DISK"] == 16
        assert answer["default"]["node-a"]["incarnation"] == state.incarnation
    finally:
        client.close()
        consumer.close()
        node.stop()
