"""The transport of one client connection of a storage node: reads frames, checks them
against the limits, moves payload bytes and answers; what each request means is the
NodeStore's (store.py), reached through a small interface and a per-connection Session.

Requests on a connection are served in order (a client gets parallelism from several
connections). Payloads move without staging copies: a PUT payload is received with
``recv_into`` straight into the DRAM slots the store reserved, and a GET answer is sent with
one scatter-gather ``sendmsg`` from the views the store pinned (SSD hits are read into a
per-request buffer first). While more than one request is in flight on the node, transfers of
at least ``server.offload_bytes`` run on a network thread. A connection that has moved such a
payload is from then on served by a thread of its own (lane.py), up to
``server.lane_connections`` of them.

Failure contract: a request the node can answer wrongly-but-safely (the store's Refused:
unknown namespace, forbidden tenant, too many bytes for one answer) gets an error response and
the connection stays open. Bytes that are not a frame, a frame over the limits, an idle or
stalled peer, a peer that has not completed AUTH within ``server.auth_timeout_s`` (whatever
it trickles), or any unexpected exception close this connection only; the node keeps serving.
A connection closed for bytes that are not a frame is one INFO line (event
``protocol_error``) at most every ``kvpool.logs.LOG_INTERVAL_S``, with the number held back.
While the node shuts down, PUTs are answered BUSY.

A connection accepted over ``server.max_connections`` is a refusal: its first request is
answered BUSY and it is closed. A (re-)AUTH starts a new identity: the namespaces declared
before it are dropped, so they must be declared again under the new token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import select
import socket
import time
from collections.abc import Sequence
from time import perf_counter
from typing import Any

from kvpool.buffers import advance
from kvpool.config import ServerConfig
from kvpool.keys import KEY_BYTES
from kvpool.logs import RateLimited
from kvpool.net.protocol import (
    HEADER_BYTES,
    KEYED_OPS,
    NS_BYTES,
    Header,
    Op,
    ProtocolError,
    Status,
    answer_frame,
    pack_flags,
    split_get_keys,
    split_keys,
    unpack_header,
)
from kvpool.server import retention
from kvpool.server.lane import Lane
from kvpool.server.store import NodeStore, Refused
from kvpool.server.traffic import DISCARD_BYTES, IOV_MAX, Traffic

log = logging.getLogger("kvpool.serve")
#: Connections closed for bytes that are not frames, logged at most once per LOG_INTERVAL_S
#: (any peer can send them, before AUTH).
_say_protocol_error = RateLimited()

_SMALL_META = 64 * 1024  # AUTH / NAMESPACE metadata
_OPS: dict[int, Op] = {op.value: op for op in Op}


class Connection:
    """``refusal``: answer the first request BUSY with this message, then close."""

    def __init__(self, store: NodeStore, traffic: Traffic, sock: socket.socket,
                 refusal: str | None = None) -> None:
        self.store = store
        self.traffic = traffic
        self.sock = sock
        self.cfg: ServerConfig = store.cfg
        self.loop = asyncio.get_running_loop()
        self.peer = _peer_name(sock)
        self.session = store.open_session(self.peer)  # the store names it in auth failures
        self.refusal = refusal
        # time.monotonic(), written by the lane thread too: the node's sweeper closes idle
        # or stalled peers
        self.last_io = time.monotonic()
        self.accepted = self.last_io
        self.cut_off: str | None = None  # why the sweeper closed it (a counter's name)
        #: It has moved a payload of server.offload_bytes or more: a lane would serve it.
        self.moves_large = False
        #: A PUT payload is being received (or read away): server.payload_stall_timeout_s
        #: applies (set by the loop or the lane thread).
        self.receiving = False

    def count(self, name: str, n: int = 1) -> None:
        self.store.counters.add(name, n)

    # ------------------------------------------------------------------ socket helpers
    async def recv_exact(self, view: memoryview) -> None:
        """Fill ``view`` from the socket. Raises ConnectionError on EOF. While other requests
        are in flight, large payloads are received on a network thread: the copy out of the
        kernel releases the GIL, so several connections move bytes on several cores and the
        loop stays responsive. A lone request skips the thread hop."""
        if view.nbytes >= self.cfg.offload_bytes and self.traffic.busy:
            await self.loop.run_in_executor(self.traffic.net_executor, self._recv_blocking,
                                            view)
            self.last_io = time.monotonic()
            return
        got = 0
        while got < view.nbytes:
            n = await self.loop.sock_recv_into(self.sock, view[got:])
            if n == 0:
                raise ConnectionError("peer closed the connection")
            got += n
            self.last_io = time.monotonic()

    async def discard(self, nbytes: int) -> None:
        scratch = memoryview(bytearray(min(nbytes, DISCARD_BYTES)))
        while nbytes:
            part = scratch[:min(nbytes, scratch.nbytes)]
            await self.recv_exact(part)
            nbytes -= part.nbytes

    def close_if_idle(self, now: float) -> None:
        """Called by the node's sweeper: a peer silent (or stalled mid-frame) for longer than
        server.idle_timeout_s, one whose PUT payload stopped arriving for longer than
        server.payload_stall_timeout_s (its reserved slots are then given back), or one
        still unauthenticated (or refused) server.auth_timeout_s after it was accepted, is
        cut off; its pending receive fails and serve() returns."""
        if self.cut_off is not None:
            return
        if now - self.last_io > self.cfg.idle_timeout_s:
            self.cut_off = "idle_closed"
        elif self.receiving and now - self.last_io > self.cfg.payload_stall_timeout_s:
            self.cut_off = "payload_stalls"
        elif (not self.session.authenticated or self.refusal is not None) and \
                now - self.accepted > self.cfg.auth_timeout_s:
            self.cut_off = "auth_timeouts"
        else:
            return
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _wait(self, events: int) -> None:
        poller = select.poll()
        poller.register(self.sock, events | select.POLLERR | select.POLLHUP)
        if not poller.poll(self.cfg.idle_timeout_s * 1000):
            raise TimeoutError("peer stalled mid-transfer")

    def _recv_blocking(self, view: memoryview) -> None:
        got = 0
        while got < view.nbytes:
            try:
                n = self.sock.recv_into(view[got:])
            except BlockingIOError:
                self._wait(select.POLLIN)
                continue
            if n == 0:
                raise ConnectionError("peer closed the connection")
            got += n
            self.last_io = time.monotonic()  # progress: not a stalled payload

    def _send_blocking(self, bufs: list[memoryview]) -> None:
        while bufs:
            try:
                sent = self.sock.sendmsg(bufs[:IOV_MAX])
            except BlockingIOError:
                self._wait(select.POLLOUT)
                continue
            advance(bufs, sent)

    async def send(self, buffers: Sequence[bytes | memoryview]) -> None:
        """Scatter-gather send of every buffer, in order; large answers go out from a network
        thread (see recv_exact)."""
        bufs = [memoryview(b).cast("B") for b in buffers if len(b)]
        if sum(b.nbytes for b in bufs) >= self.cfg.offload_bytes and self.traffic.busy:
            await self.loop.run_in_executor(self.traffic.net_executor, self._send_blocking,
                                            bufs)
            self.last_io = time.monotonic()
            return
        while bufs:
            try:
                sent = self.sock.sendmsg(bufs[:IOV_MAX])
            except BlockingIOError:
                sent = 0
            advance(bufs, sent)
            if bufs and not sent:
                # The socket buffer is full: let the loop wait until the first piece is out.
                await self.loop.sock_sendall(self.sock, bufs.pop(0))
            self.last_io = time.monotonic()

    async def reply(self, req: Header, status: Status = Status.OK, count: int = 0,
                    meta: bytes = b"", payload: Sequence[memoryview] = ()) -> None:
        await self.send(answer_frame(req, status, count, meta, payload))

    # ------------------------------------------------------------------ main loop
    async def serve(self) -> None:
        """Serve requests until the peer leaves, a frame breaks the rules, the node drains
        or the sweeper cuts the peer off; never raises (see the module docstring)."""
        header_buf = memoryview(bytearray(HEADER_BYTES))
        traffic = self.traffic
        try:
            while True:
                await self.recv_exact(header_buf)
                req = unpack_header(header_buf)
                traffic.begin()
                try:
                    keep = await self.handle(req)
                finally:
                    traffic.end()
                if not keep or traffic.draining:
                    return
                if self.moves_large and traffic.take_lane():
                    self.count("lanes_started")
                    await Lane(self).run()  # serves the rest of the connection's requests
                    return
        except Exception as exc:  # never let one connection take the node down
            self.ended_by(exc)
        finally:
            self.store.close_session(self.session)

    def ended_by(self, exc: Exception) -> None:
        """Count (and log, rate-limited where a peer could flood the log) what ended the
        connection: a malformed frame, the peer leaving or being cut off, or a bug here.
        Never raises."""
        if isinstance(exc, ProtocolError):
            self.count("protocol_errors")
            held = _say_protocol_error.due()
            if held is not None:  # garbage from anyone: a flood must not flood the log
                log.info("closing %s: %s%s", self.peer, exc,
                         f" ({held} more since the last report)" if held else "",
                         extra={"event": "protocol_error", "peer": self.peer,
                                "held_back": held})
        elif isinstance(exc, (ConnectionError, OSError)):
            if self.cut_off is not None:
                self.count(self.cut_off)
        else:
            self.count("internal_errors")
            log.error("closing %s after an unexpected error", self.peer, exc_info=exc,
                      extra={"event": "internal_error", "peer": self.peer})

    async def handle(self, req: Header) -> bool:
        """Serve one request; False when the connection must close afterwards."""
        op = self.check(req)
        started = perf_counter()
        meta = memoryview(bytearray(req.meta_len))
        await self.recv_exact(meta)
        return await self.answer(op, req, meta, started)

    def check(self, req: Header) -> Op:
        """The request's op; raises ProtocolError for an unknown one or a frame over the
        limits."""
        op = _OPS.get(req.op)  # a dict, not Op(...): the enum's call costs microseconds
        if op is None:
            raise ProtocolError(f"unknown opcode {req.op}")
        self._check_limits(op, req)
        return op

    async def answer(self, op: Op, req: Header, meta: memoryview, started: float) -> bool:
        """Answer a request whose metadata is read (``started``: when it arrived); False when
        the connection must close afterwards."""
        name = op.name.lower()
        self.count(f"op_{name}")
        try:
            if self.refusal is not None:
                raise Refused(Status.BUSY, self.refusal, close=True)
            if op is not Op.AUTH and not self.session.authenticated:
                raise Refused(Status.AUTH_REQUIRED, "this node requires AUTH first", close=True)
            await self._dispatch(op, req, meta)
        except Refused as refused:
            self.count_refused(refused)
            await self.reply(req, refused.status, meta=refused.message.encode())
            return not refused.close
        finally:
            self.record_latency(name, started)
        return True

    def refuse_put_if_stopping(self) -> None:
        """While the node shuts down a PUT is refused BUSY (a client counts a dropped
        save); reads are still answered."""
        if self.traffic.draining:
            raise Refused(Status.BUSY, f"node {self.store.node_id} is shutting down")

    def count_refused(self, refused: Refused) -> None:
        self.store.counters.add_many({"refused": 1,
                                      f"refused_{refused.status.name.lower()}": 1})

    def record_latency(self, op_name: str, started: float) -> None:
        if self.traffic.latency is not None:
            self.traffic.latency.record(op_name, perf_counter() - started)

    def _check_limits(self, op: Op, req: Header) -> None:
        cfg = self.cfg
        keyed = op in KEYED_OPS
        max_meta = NS_BYTES + cfg.max_keys * KEY_BYTES if keyed else _SMALL_META
        if req.is_response or req.status:
            raise ProtocolError("a request must not carry a status or the response bit")
        if req.meta_len > max_meta:
            raise ProtocolError(f"{op.name} metadata of {req.meta_len} bytes exceeds {max_meta}")
        if req.count > cfg.max_keys:
            raise ProtocolError(f"{op.name} with {req.count} keys exceeds max_keys "
                                f"{cfg.max_keys}")
        if req.payload_len and op is not Op.PUT:
            raise ProtocolError(f"{op.name} must not carry a payload")
        if req.meta_len + req.payload_len > cfg.max_frame_bytes:
            raise ProtocolError(f"frame of {req.meta_len + req.payload_len} bytes exceeds "
                                f"max_frame_bytes {cfg.max_frame_bytes}")

    async def _dispatch(self, op: Op, req: Header, meta: memoryview) -> None:
        store, session = self.store, self.session
        if op is Op.AUTH:
            await self.reply(req, meta=store.authenticate(session, bytes(meta)))
        elif op is Op.PING:
            await self.reply(req)
        elif op is Op.NAMESPACE:
            features, ns_id = store.declare(session, bytes(meta))
            await self.reply(req, count=features, meta=ns_id)
        elif op is Op.STATS:
            transport = {"connections": len(self.traffic.served),
                         "inflight_requests": self.traffic.inflight,
                         "lanes": self.traffic.lanes}
            stats = await store.stats(session, transport)
            await self.reply(req, meta=json.dumps(stats, default=str).encode())
        elif op is Op.INVALIDATE:
            if req.meta_len != NS_BYTES:
                raise ProtocolError("INVALIDATE metadata must be one namespace id")
            await self.reply(req, count=await store.invalidate(session, bytes(meta)))
        elif op is Op.RETAIN:
            await self.reply(req, count=retention.retain(store, session, meta, req.count))
        elif op is Op.RELEASE:
            await self.reply(req, count=await retention.release(store, session, meta))
        elif op is Op.GET:
            ns_id, keys, touch = split_get_keys(meta, req.count)
            await self._get(req, ns_id, keys, touch)
        else:
            ns_id, keys = split_keys(meta, req.count)
            if op is Op.PUT:
                await self._put(req, ns_id, keys)
            elif op is Op.EXISTS_PREFIX:
                run = store.exists_prefix_now(session, ns_id, keys) if self._probe_inline(req) \
                    else await store.exists_prefix(session, ns_id, keys)
                await self.reply(req, count=run)
            elif op is Op.EXISTS:
                held = store.exists_now(session, ns_id, keys) if self._probe_inline(req) \
                    else await store.exists(session, ns_id, keys)
                await self.reply(req, count=sum(held), meta=pack_flags(held))
            elif op is Op.TOUCH:
                await self.reply(req, count=store.touch(session, ns_id, keys))
            else:
                await self.reply(req, count=await store.delete(session, ns_id, keys))

    def _probe_inline(self, req: Header) -> bool:
        """A lone small existence probe runs on the loop: with no other request in flight
        nobody waits behind it, and the worker hop (two thread wake-ups, on a loaded
        machine each a chance to wait for a core) cost more than the probe itself."""
        if req.count <= self.cfg.inline_exists_keys and self.traffic.inflight <= 1:
            self.count("probes_inline")
            return True
        return False

    async def _put(self, req: Header, ns_id: bytes, keys: list[bytes]) -> None:
        self.receiving = True
        try:
            await self._receive_put(req, ns_id, keys)
        finally:
            self.receiving = False

    async def _receive_put(self, req: Header, ns_id: bytes, keys: list[bytes]) -> None:
        try:
            self.refuse_put_if_stopping()
            batch = await self.store.begin_put(self.session, ns_id, keys, req.payload_len)
        except Refused:
            await self.discard(req.payload_len)  # the frame stays in step; then answer
            raise
        if req.payload_len >= self.cfg.offload_bytes:
            self.moves_large = True
        try:
            for target in batch.targets:
                if target is None:
                    await self.discard(batch.ns.chunk_bytes)
                else:
                    await self.recv_exact(target)
            self.receiving = False  # all arrived; a durable commit's sync is not a stall
            stored = await self.store.commit_put(batch)
        finally:
            batch.abort()
        await self.reply(req, count=stored)

    async def _get(self, req: Header, ns_id: bytes, keys: list[bytes],
                   touch: list[bytes]) -> None:
        answer = await self.store.get(self.session, ns_id, keys, touch)
        if sum(v.nbytes for v in answer.views) >= self.cfg.offload_bytes:
            self.moves_large = True
        try:
            await self.reply(req, count=len(answer.views), meta=answer.flags,
                             payload=answer.views)
        finally:
            answer.release()


def _peer_name(sock: socket.socket) -> str:
    try:
        peer: Any = sock.getpeername()
        return f"{peer[0]}:{peer[1]}"
    except OSError:
        return "<unknown peer>"
