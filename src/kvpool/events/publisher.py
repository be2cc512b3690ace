"""The publisher: tiers' events into a bounded queue, one thread that batches, encodes and
sends them on a ZMQ PUB socket and answers replay requests on a ROUTER socket, as vLLM's
``ZmqEventPublisher`` does (docs/routing.md).

Never blocks the data path: ``TierEvents`` calls take a short lock and append (O(1)); past
``queue_events`` queued events an event is dropped and counted, and the next batch sent
skips one sequence number, so every consumer sees a gap that replay cannot fill. A failed
send is logged (rate-limited), counted as dropped and likewise leaves a gap; the thread
never dies of it. The sockets live on the publisher thread only (ZMQ sockets are not
thread-safe).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from kvpool.events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    encode,
)
from kvpool.keys import Namespace
from kvpool.logs import RateLimited

log = logging.getLogger(__name__)

#: vLLM's end-of-replay sequence marker.
END_SEQ = (-1).to_bytes(8, "big", signed=True)

_STORED, _REMOVED, _CLEARED = 0, 1, 2


@dataclass(frozen=True)
class PublisherSettings:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    replay_port: int = 0
    topic: str = "kvpool"
    queue_events: int = 65536
    replay_batches: int = 10000
    batch_interval_s: float = 0.05
    hwm: int = 100_000
    #: KVEventBatch.key_scope: "" (chunk keys) or "namespace" (a node's filed keys)
    key_scope: str = ""
    #: The host consumers should dial, named in the endpoints (``/events``) when ``host`` is
    #: a wildcard (0.0.0.0, ::): a node's server.advertise_host. None: ``host`` itself.
    advertise: str | None = None


WILDCARDS = frozenset({"0.0.0.0", "::", "*", ""})


def dial_host(settings: PublisherSettings) -> str:
    """The host the endpoints name: ``advertise`` where the sockets are bound on a wildcard
    address (which no consumer can dial), else the bound host."""
    if settings.host in WILDCARDS and settings.advertise:
        return settings.advertise
    return settings.host


def new_incarnation() -> str:
    return os.urandom(8).hex()


class _MediumSink:
    """A TierEvents bound to one medium (and tenant, on a host pool) of one publisher."""

    __slots__ = ("_medium", "_offer", "_tenant")

    def __init__(self, publisher: EventPublisher, medium: str, tenant: str | None) -> None:
        self._offer = publisher.offer
        self._medium = medium
        self._tenant = tenant

    def stored(self, keys: Sequence[bytes], namespace: Namespace | bytes) -> None:
        self._offer(_STORED, self._medium, namespace, keys, self._tenant)

    def removed(self, keys: Sequence[bytes], namespace: Namespace | bytes) -> None:
        self._offer(_REMOVED, self._medium, namespace, keys, self._tenant)

    def cleared(self, namespace: Namespace | bytes) -> None:
        self._offer(_CLEARED, self._medium, namespace, (), self._tenant)


#: A queued event: kind, medium, namespace, keys, tenant.
_Item = tuple[int, str, Namespace | bytes, tuple[bytes, ...], str | None]


class EventPublisher:
    """Binds PUB and ROUTER sockets on ``settings.host`` (raises zmq.ZMQError, e.g. a port
    in use) and starts the publisher thread. ``node``: who holds the chunks (a node id or a
    host name). ``close`` sends what is queued (within a second) and releases the sockets."""

    def __init__(self, settings: PublisherSettings, node: str) -> None:
        self.settings = settings
        self.node = node
        self.incarnation = new_incarnation()
        self._lock = threading.Lock()
        self._queue: deque[_Item] = deque()
        self._cap = settings.queue_events
        self._dropped_pending = 0  # dropped since the last batch: the next one skips a seq
        self._chunk_tokens: dict[bytes, int] = {}
        self.next_seq = 0
        #: events published per medium, batches sent, events dropped, replay requests
        self.published: dict[str, int] = {}
        self.batches = 0
        self.dropped = 0
        self.replays = 0
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=settings.replay_batches)
        self._topic = settings.topic.encode()
        self._say_failed = RateLimited()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = self._ctx.socket(zmq.ROUTER)
        try:
            self._pub.set_hwm(settings.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._replay.setsockopt(zmq.LINGER, 0)
            self.port = _bind(self._pub, settings.host, settings.port)
            self.replay_port = _bind(self._replay, settings.host, settings.replay_port)
        except BaseException:
            self._pub.close(0)
            self._replay.close(0)
            raise
        dial = dial_host(settings)
        host = f"[{dial}]" if ":" in dial else dial
        self.endpoint = f"tcp://{host}:{self.port}"
        self.replay_endpoint = f"tcp://{host}:{self.replay_port}"
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvpool-events", daemon=True)
        self._thread.start()
        log.debug("kv events on %s (replay %s), node %s, incarnation %s", self.endpoint,
                  self.replay_endpoint, node, self.incarnation,
                  extra={"event": "events_listening", "endpoint": self.endpoint,
                         "replay_endpoint": self.replay_endpoint, "node": node,
                         "incarnation": self.incarnation})

    def sink(self, medium: str, tenant: str | None = None) -> _MediumSink:
        """The TierEvents a tier of ``medium`` calls; ``tenant``: the tenant whose pool the
        tier is (a host pool with several tenants), carried by every event it sends."""
        return _MediumSink(self, medium, tenant)

    def offer(self, kind: int, medium: str, namespace: Namespace | bytes,
              keys: Sequence[bytes], tenant: str | None = None) -> None:
        """Queue one event; past the bound, drop it (counted). Never blocks, never raises."""
        with self._lock:
            if len(self._queue) >= self._cap or not self._running:
                self.dropped += 1
                self._dropped_pending += 1
                return
            self._queue.append((kind, medium, namespace, tuple(keys), tenant))

    def info(self) -> dict[str, object]:
        """What ``GET /events`` answers."""
        return {"node": self.node, "incarnation": self.incarnation, "endpoint": self.endpoint,
                "replay_endpoint": self.replay_endpoint, "topic": self.settings.topic,
                "key_scope": self.settings.key_scope, "next_seq": self.next_seq,
                "published": sum(self.published.values()), "dropped": self.dropped}

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        timeout_ms = max(1, int(self.settings.batch_interval_s * 1000))
        while True:
            try:
                if poller.poll(timeout_ms):
                    self._serve_replay()
                running = self._running
                self._send_queued()
            except Exception as exc:  # never the thread's end: a gap, logged rate-limited
                self._failed(exc)
                running = self._running
            if not running:
                return

    def _take(self) -> tuple[list[_Item], int]:
        with self._lock:
            items = list(self._queue)
            self._queue.clear()
            dropped, self._dropped_pending = self._dropped_pending, 0
        return items, dropped

    def _send_queued(self) -> None:
        items, dropped = self._take()
        if dropped:
            self.next_seq += 1  # the batch those events would have been: a visible gap
        if not items:
            return
        events = self._events(items)
        batch = KVEventBatch(ts=time.time(), events=list(events), node=self.node,
                             incarnation=self.incarnation, key_scope=self.settings.key_scope)
        seq = self.next_seq
        self.next_seq += 1
        payload = encode(batch)
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except zmq.ZMQError as exc:
            self.dropped += len(items)
            self._failed(exc)
            return
        self._ring.append((seq, payload))
        self.batches += 1
        for _kind, medium, _, _keys, _tenant in items:
            self.published[medium] = self.published.get(medium, 0) + 1

    def _events(self, items: list[_Item]) -> list[KVEvent]:
        """Consecutive events of one kind, medium, namespace and tenant become one (keys
        joined)."""
        out: list[KVEvent] = []
        last: tuple[int, str, bytes, str | None] | None = None
        for kind, medium, namespace, keys, tenant in items:
            if isinstance(namespace, Namespace):
                ns_id = namespace.id
                self._chunk_tokens[ns_id] = namespace.chunk_tokens
            else:
                ns_id = bytes(namespace)
            ident = (kind, medium, ns_id, tenant)
            if ident == last and kind != _CLEARED:
                prev = out[-1]
                assert isinstance(prev, BlockStored | BlockRemoved)
                prev.block_hashes.extend(keys)
                continue
            last = ident
            if kind == _STORED:
                out.append(BlockStored(list(keys), None, [], self._chunk_tokens.get(ns_id, 0),
                                       None, medium, None, ns_id, tenant))
            elif kind == _REMOVED:
                out.append(BlockRemoved(list(keys), medium, ns_id, tenant))
            else:
                out.append(AllBlocksCleared(medium, ns_id, tenant))
        return out

    def _serve_replay(self) -> None:
        """One replay request: every batch of the ring from the asked seq, then END_SEQ. A
        malformed request is ignored (logged rate-limited)."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            self._failed(ValueError(f"malformed replay request ({len(frames)} frames)"))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        self.replays += 1
        for seq, payload in list(self._ring):
            if seq >= start:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"),
                                             payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _failed(self, exc: BaseException) -> None:
        held = self._say_failed.due()
        if held is not None:
            log.warning("kv events: %s%s", exc,
                        f" ({held} more since the last report)" if held else "",
                        extra={"event": "events_failed", "held_back": held})

    def close(self) -> None:
        """Publish what is queued, stop the thread, close the sockets. Idempotent."""
        if not self._running:
            return
        self._running = False
        self._thread.join(timeout=5)
        self._pub.close(0)
        self._replay.close(0)


def _bind(sock: zmq.Socket[bytes], host: str, port: int) -> int:
    """Bind to host:port (0: a free port); returns the port bound."""
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
        host = f"[{host}]"
    if port == 0:
        return int(sock.bind_to_random_port(f"tcp://{host}"))
    sock.bind(f"tcp://{host}:{port}")
    return port
