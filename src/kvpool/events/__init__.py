"""KV events: what enters and leaves a pool's tiers, published in vLLM's KV event format
(msgpack over ZMQ PUB, sequence numbers, a replay socket) so routers and indexers know what
each node holds (docs/routing.md).

- ``sink.py``: the tiny interface the tiers call (no ZMQ, no msgspec: core storage imports it);
- ``schema.py``: the msgspec structures, vLLM's with kvpool's fields added;
- ``publisher.py``: the bounded queue, the publisher thread, the PUB and replay sockets;
- ``consumer.py``: a subscriber that follows incarnations and fills gaps through replay;
- ``attach.py``: wiring a publisher to a pool's tiers, and its metrics.
"""
