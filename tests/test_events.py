"""KV events of an embedded pool (opt-in) and the publisher's bounded queue, over real ZMQ
sockets on 127.0.0.1: stored / removed / cleared per medium with the chunk keys themselves,
and a full queue dropping events that consumers see as a gap they reset on."""

from __future__ import annotations

from pathlib import Path

from kvtest import byte_namespace, payload_for, small_config, wait_for

from kvpool.events.consumer import EventConsumer
from kvpool.events.publisher import EventPublisher, PublisherSettings
from kvpool.events.sink import MEDIUM_CPU, MEDIUM_DISK
from kvpool.pool import KVPool

CHUNK = 64 * 1024


def test_an_embedded_pool_publishes_only_when_asked(tmp_path: Path) -> None:
    with KVPool(small_config(tmp_path / "off")) as pool:
        assert pool.events is None  # events.enabled unset: off for an embedded pool
    ns = byte_namespace(CHUNK)
    keys = ns.chunk_keys(list(range(6)))
    pool = KVPool(small_config(tmp_path / "on", events={"enabled": True,
                                                         "batch_interval_s": 0.02}))
    pub = pool.events
    assert pub is not None
    consumer = EventConsumer([(pub.endpoint, pub.replay_endpoint)])
    try:
        pool.register_namespace(ns)
        assert pool.put_many(ns, keys, [payload_for(k, CHUNK) for k in keys]) == 6
        assert pool.flush(30)

        def held(medium: str) -> set[bytes]:
            consumer.poll(0.05)
            return consumer.held(pub.node, medium, ns.id)

        wait_for(lambda: held(MEDIUM_CPU) == held(MEDIUM_DISK) == set(keys), 30,
                 "six chunks stored in DRAM and on SSD, announced under their own keys")
        assert consumer.prefix(pub.node, MEDIUM_DISK, ns.id, keys) == 6
        assert pool.delete(ns, keys[3])
        wait_for(lambda: held(MEDIUM_DISK) == held(MEDIUM_CPU) == set(keys) - {keys[3]}, 30,
                 "the deleted chunk announced removed")
        assert consumer.prefix(pub.node, MEDIUM_CPU, ns.id, keys) == 3
        pool.invalidate(ns)
        wait_for(lambda: not held(MEDIUM_DISK) and not held(MEDIUM_CPU), 30,
                 "the namespace announced cleared")
        assert consumer.nodes[pub.node].resets == 0
    finally:
        pool.close()
        consumer.close()


def test_a_full_queue_drops_events_and_the_gap_resets_consumers(tmp_path: Path) -> None:
    ns = byte_namespace(CHUNK)
    keys = ns.chunk_keys(list(range(8)))
    pub = EventPublisher(PublisherSettings(queue_events=2, batch_interval_s=0.3), "host-a")
    resets: list[str] = []
    consumer = EventConsumer([(pub.endpoint, pub.replay_endpoint)], on_reset=resets.append)
    sink = pub.sink(MEDIUM_CPU)
    try:
        sink.stored(keys[:1], ns)
        wait_for(lambda: consumer.poll(0.05) >= 0 and
                 consumer.held("host-a", MEDIUM_CPU, ns.id) == {keys[0]}, 30, "first batch")
        for key in keys[1:6]:  # more than the queue holds before the thread's next round
            sink.stored([key], ns)
        assert pub.dropped >= 1
        wait_for(lambda: consumer.poll(0.05) >= 0 and resets == ["host-a"], 30,
                 "the gap left by the dropped events resets the consumer")
        state = consumer.nodes["host-a"]
        assert state.last_seq == pub.next_seq - 1
        # after the reset only what came after the gap is known; never a dropped chunk
        assert keys[0] not in consumer.held("host-a", MEDIUM_CPU, ns.id)
        sink.stored(keys[6:7], ns)
        wait_for(lambda: consumer.poll(0.05) >= 0 and
                 keys[6] in consumer.held("host-a", MEDIUM_CPU, ns.id), 30, "events go on")
        assert resets == ["host-a"] and pub.info()["dropped"] == pub.dropped
    finally:
        pub.close()
        consumer.close()


def test_endpoints_name_the_advertised_host_when_bound_on_a_wildcard() -> None:
    """A publisher bound on 0.0.0.0 names the advertised host in its endpoints (what GET
    /events answers: no consumer can dial 0.0.0.0), and a consumer dialling them receives
    its batches; bound on a specific address it names that address."""
    wild = EventPublisher(PublisherSettings(host="0.0.0.0", advertise="127.0.0.1",
                                            batch_interval_s=0.02), "node-w")
    plain = EventPublisher(PublisherSettings(host="127.0.0.1", advertise="elsewhere"), "node-p")
    consumer = EventConsumer([(wild.endpoint, wild.replay_endpoint)])
    try:
        assert wild.info()["endpoint"] == f"tcp://127.0.0.1:{wild.port}"
        assert wild.replay_endpoint == f"tcp://127.0.0.1:{wild.replay_port}"
        assert plain.endpoint == f"tcp://127.0.0.1:{plain.port}"
        ns = byte_namespace(CHUNK)
        keys = ns.chunk_keys(list(range(2)))
        sink = wild.sink(MEDIUM_CPU)

        def received() -> bool:
            sink.stored(keys, ns)  # again until the subscription is up (PUB drops before)
            consumer.poll(0.05)
            return consumer.held("node-w", MEDIUM_CPU, ns.id) == set(keys)

        wait_for(received, 30, "a batch received through the advertised endpoint")
    finally:
        consumer.close()
        wild.close()
        plain.close()
