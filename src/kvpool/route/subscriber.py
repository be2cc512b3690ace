"""One ZMQ SUB per KV-event publisher, feeding an index on the router's event loop.

Messages are vLLM's three frames ``[topic, seq (8 bytes big-endian), msgpack payload]``. A
message of another shape or an undecodable payload is counted and dropped (the next good
batch then shows as a gap, which resets the index). The socket reconnects by itself (ZMQ);
a publisher that went away and came back shows as a restart (seq back to 0, or a new
incarnation) and resets the index.
"""

from __future__ import annotations

import logging

import msgspec
import zmq
import zmq.asyncio

from kvpool.route.index import EngineIndex, PoolIndex

log = logging.getLogger(__name__)


class Subscriber:
    """Subscribes to ``endpoint`` and applies every batch to ``index``; ``run`` until
    cancelled."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str,
                 index: EngineIndex | PoolIndex, topic: bytes = b"") -> None:
        self.endpoint = endpoint
        self.index = index
        self.bad_messages = 0
        self._sock = ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._decoder = msgspec.msgpack.Decoder()

    async def run(self) -> None:
        try:
            while True:
                frames = await self._sock.recv_multipart()
                self.handle(frames)
        finally:
            self._sock.close(0)

    def handle(self, frames: list[bytes]) -> None:
        """Apply one message; a malformed one is counted and dropped, never raised."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.bad_messages += 1
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        try:
            self.index.apply(seq, self._decoder.decode(frames[2]))
        except (msgspec.DecodeError, ValueError) as exc:
            self.bad_messages += 1
            log.warning("KV events from %s: dropped a bad batch (%s)", self.endpoint, exc)

