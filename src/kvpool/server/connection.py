"""The transport of one client connection of a storage node: a thread of its own with a
blocking socket reads frames, checks them against the limits, moves payload bytes and
answers; what each request means is the NodeStore's (store.py), reached through a small
interface and a per-connection Session.

One concurrency model for every request: the connection's thread serves it from the first
byte to the last (the node's event loop only accepts connections, sweeps idle ones and
handles signals, node.py). Blocking calls (a lower-tier read, a wait for pinned slots, a
durable sync, a warm start's declare) block only the connection that asked; the GIL is
released in every socket call and the copies out of the kernel, so connections move bytes on
several cores. Requests on a connection are served in order (a client gets parallelism from
several connections).

One receive path (``recv``, ``take``): a request's header and keys arrive together, so one
receive into the connection's inbox serves both (parsed where they lie); a large payload is
received straight into the DRAM slots the store reserved (no staging copy). One send path
(``send``, ``write``): one scatter-gather ``sendmsg`` of the answer's header, metadata and the
views the store pinned (TLS, server/tls.py, replaces only the socket write underneath).

Failure contract: a request the node can answer wrongly-but-safely (the store's Refused:
unknown namespace, forbidden tenant, too many bytes for one answer) gets an error response and
the connection stays open. Bytes that are not a frame, a frame over the limits, an idle or
stalled peer, a peer that has not completed AUTH within ``server.auth_timeout_s`` (whatever
it trickles), or any unexpected exception close this connection only; the node keeps serving.
The sweeper (and the node's stop) cut a connection off by shutting its socket down, which
ends the thread's blocking call. A connection closed for bytes that are not a frame is one
INFO line (event ``protocol_error``) at most every ``kvpool.logs.LOG_INTERVAL_S``, with the
number held back. While the node shuts down, PUTs are answered BUSY.

A connection accepted over ``server.max_connections`` is a refusal: its first request is
answered BUSY and it is closed. A (re-)AUTH starts a new identity: the namespaces declared
before it are dropped, so they must be declared again under the new token.
"""

from __future__ import annotations

import contextlib
import json
import logging
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
    HEADER,
    HEADER_BYTES,
    KEYED_OPS,
    MAGIC,
    NS_BYTES,
    PROTOCOL_VERSION,
    RESPONSE_BIT,
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
from kvpool.server.store import NodeStore, Refused
from kvpool.server.traffic import Traffic

log = logging.getLogger("kvpool.serve")
#: Connections closed for bytes that are not frames, logged at most once per LOG_INTERVAL_S
#: (any peer can send them, before AUTH).
_say_protocol_error = RateLimited()

_SMALL_META = 64 * 1024  # AUTH / NAMESPACE metadata
_OPS: dict[int, Op] = {op.value: op for op in Op}
_NAMES: dict[Op, str] = {op: op.name.lower() for op in Op}
_COUNTERS: dict[Op, str] = {op: f"op_{op.name.lower()}" for op in Op}
IOV_MAX = 512  # iovecs per sendmsg, under the kernel's UIO_MAXIOV
DISCARD_BYTES = 1 << 20  # scratch for payload bytes read away
#: The receive buffer: a request's header and up to ~1,000 keys in one receive.
INBOX_BYTES = 16 << 10


class Connection:
    """One client connection; ``serve`` runs on its own thread. ``refusal``: answer the
    first request BUSY with this message, then close."""

    #: Flags of a payload's receive: all of it in one call (an SSL socket takes none).
    PAYLOAD_RECV_FLAGS: int = socket.MSG_WAITALL

    def __init__(self, store: NodeStore, traffic: Traffic, sock: socket.socket,
                 refusal: str | None = None) -> None:
        self.store = store
        self.traffic = traffic
        self.sock = sock
        self.cfg: ServerConfig = store.cfg
        self.peer = _peer_name(sock)
        self.session = store.open_session(self.peer)  # the store names it in auth failures
        self.refusal = refusal
        # time.monotonic(), written by the connection's thread: the node's sweeper closes
        # idle or stalled peers
        self.last_io = time.monotonic()
        self.accepted = self.last_io
        self.cut_off: str | None = None  # why the sweeper closed it (a counter's name)
        #: A PUT payload is being received (or read away): server.payload_stall_timeout_s
        #: applies.
        self.receiving = False
        # Received bytes not yet consumed: a request's header and keys arrive together, so
        # one receive into here serves both (one syscall a request, not two).
        self._inbox = memoryview(bytearray(INBOX_BYTES))
        self._have = self._used = 0

    def count(self, name: str, n: int = 1) -> None:
        self.store.counters.add(name, n)

    # ------------------------------------------------------------------ from the loop
    def close_if_idle(self, now: float) -> None:
        """Called by the node's sweeper: a peer silent (or stalled mid-frame) for longer than
        server.idle_timeout_s, one whose PUT payload stopped arriving for longer than
        server.payload_stall_timeout_s (its reserved slots are then given back), or one
        still unauthenticated (or refused) server.auth_timeout_s after it was accepted, is
        cut off; its pending receive or send fails and ``serve`` returns."""
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
        self.shut()

    def shut(self) -> None:
        """End the thread's blocking call (the sweeper, the node's stop); never raises."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    # ------------------------------------------------------------------ on the thread
    def serve(self) -> None:
        """Serve requests until the peer leaves, a frame breaks the rules, the node drains
        or the sweeper cuts the peer off; never raises (see the module docstring)."""
        try:
            if not self.open():
                return
            self.sock.setblocking(True)
            traffic = self.traffic
            busy = traffic.busy
            while True:
                req = unpack_header(self.take(HEADER_BYTES))
                busy.add(self)
                try:
                    keep = self.handle(req)
                finally:
                    busy.discard(self)
                if not keep or traffic.draining:
                    return
        except Exception as exc:  # never let one connection take the node down
            self.ended_by(exc)
        finally:
            self.store.close_session(self.session)

    def open(self) -> bool:
        """What comes before the first frame (TLS: the handshake); False when the connection
        must close without serving."""
        return True

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

    def recv(self, view: memoryview) -> None:
        """Fill ``view``: a small one (under INBOX_BYTES) through the inbox (``take``), a
        large one (a payload) with what the inbox holds, then straight from the socket.
        Raises ConnectionError on EOF (or a socket the sweeper shut)."""
        nbytes = view.nbytes
        if nbytes < INBOX_BYTES:
            view[:] = self.take(nbytes)
            return
        got = min(nbytes, self._have - self._used)
        if got:
            view[:got] = self._inbox[self._used:self._used + got]
            self._used += got
        while got < nbytes:
            n = self.sock.recv_into(view[got:], 0, self.PAYLOAD_RECV_FLAGS)
            if n == 0:
                raise ConnectionError("peer closed the connection")
            got += n
            self.last_io = time.monotonic()  # progress: not a stalled payload

    def take(self, nbytes: int) -> memoryview:
        """The next ``nbytes`` (less than INBOX_BYTES) received, as a view of the inbox valid
        until the next receive: what the inbox holds already, the rest received after it (a
        request's header and keys usually arrive in one receive). Raises ConnectionError on
        EOF."""
        used, have = self._used, self._have
        if have - used < nbytes:
            inbox, left = self._inbox, have - used
            inbox[:left] = inbox[used:have]  # what is left of the last receive goes first
            used, have = 0, left
            while have < nbytes:
                n = self.sock.recv_into(inbox[have:])
                if n == 0:
                    self._have = self._used = 0
                    raise ConnectionError("peer closed the connection")
                have += n
            self._have = have
            self.last_io = time.monotonic()
        self._used = used + nbytes
        return self._inbox[used:used + nbytes]

    def discard(self, nbytes: int) -> None:
        """Read ``nbytes`` of payload away (a refused PUT: the frame stays in step)."""
        scratch = memoryview(bytearray(min(nbytes, DISCARD_BYTES)))
        while nbytes:
            part = scratch[:min(nbytes, scratch.nbytes)]
            self.recv(part)
            nbytes -= part.nbytes

    def send(self, buffers: Sequence[bytes | memoryview]) -> None:
        """Send every buffer, in order."""
        self.write([memoryview(b).cast("B") for b in buffers if len(b)])

    def write(self, bufs: list[memoryview]) -> None:
        """The socket write under ``send``: scatter-gather, IOV_MAX buffers a call (flat
        ``B`` views, none empty)."""
        sendmsg = self.sock.sendmsg
        while True:
            sent = sendmsg(bufs if len(bufs) <= IOV_MAX else bufs[:IOV_MAX])
            self.last_io = time.monotonic()
            advance(bufs, sent)
            if not bufs:
                return

    def reply(self, req: Header, status: Status = Status.OK, count: int = 0,
              meta: bytes = b"", payload: Sequence[memoryview] = ()) -> None:
        self.send(answer_frame(req, status, count, meta, payload))

    def handle(self, req: Header) -> bool:
        """Serve one request whose header is read; False when the connection must close
        afterwards."""
        op = self.check(req)
        started = perf_counter()
        if req.meta_len < INBOX_BYTES:
            meta: bytes | memoryview = self.take(req.meta_len).tobytes()
        else:
            meta = memoryview(bytearray(req.meta_len))
            self.recv(meta)
        self.count(_COUNTERS[op])  # on arrival: an answer the peer never reads still counts
        try:
            if self.refusal is not None:
                raise Refused(Status.BUSY, self.refusal, close=True)
            if op is not Op.AUTH and not self.session.authenticated:
                raise Refused(Status.AUTH_REQUIRED, "this node requires AUTH first", close=True)
            self._dispatch(op, req, meta)
        except Refused as refused:
            self.store.counters.add_many({"refused": 1,
                                          f"refused_{refused.status.name.lower()}": 1})
            self.reply(req, refused.status, meta=refused.message.encode())
            return not refused.close
        finally:
            if self.traffic.latency is not None:
                self.traffic.latency.record(_NAMES[op], perf_counter() - started)
        return True

    def check(self, req: Header) -> Op:
        """The request's op; raises ProtocolError for an unknown one or a frame over the
        limits."""
        op = _OPS.get(req.op)  # a dict, not Op(...): the enum's call costs microseconds
        if op is None:
            raise ProtocolError(f"unknown opcode {req.op}")
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
        return op

    # ------------------------------------------------------------------ the ops
    def _dispatch(self, op: Op, req: Header, meta: bytes | memoryview) -> None:
        store, session = self.store, self.session
        if op is Op.GET:
            self._get(req, *split_get_keys(meta, req.count))
        elif op is Op.AUTH:
            self.reply(req, meta=store.authenticate(session, bytes(meta)))
        elif op is Op.PING:
            self.reply(req)
        elif op is Op.NAMESPACE:
            features, ns_id = store.declare(session, bytes(meta))
            self.reply(req, count=features, meta=ns_id)
        elif op is Op.STATS:
            transport = {"connections": self.traffic.connections,
                         "inflight_requests": self.traffic.inflight}
            stats = store.stats(session, transport)
            self.reply(req, meta=json.dumps(stats, default=str).encode())
        elif op is Op.INVALIDATE:
            if req.meta_len != NS_BYTES:
                raise ProtocolError("INVALIDATE metadata must be one namespace id")
            self.reply(req, count=store.invalidate(session, bytes(meta)))
        elif op is Op.RETAIN:
            self.reply(req, count=retention.retain(store, session, meta, req.count))
        elif op is Op.RELEASE:
            self.reply(req, count=retention.release(store, session, meta))
        else:
            ns_id, keys = split_keys(meta, req.count)
            if op is Op.PUT:
                self._put(req, ns_id, keys)
            elif op is Op.EXISTS_PREFIX:
                self.reply(req, count=store.exists_prefix(session, ns_id, keys))
            elif op is Op.EXISTS:
                held = store.exists(session, ns_id, keys)
                self.reply(req, count=sum(held), meta=pack_flags(held))
            elif op is Op.TOUCH:
                self.reply(req, count=store.touch(session, ns_id, keys))
            else:
                self.reply(req, count=store.delete(session, ns_id, keys))

    def _get(self, req: Header, ns_id: bytes, keys: list[bytes], touch: list[bytes]) -> None:
        answer = self.store.get(self.session, ns_id, keys, touch)
        try:
            views, flags = answer.views, answer.flags
            head = HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, req.op | RESPONSE_BIT, req.req_id,
                               len(views), len(flags), sum(map(len, views)))
            self.write([memoryview(head + flags), *views])  # the store's views are flat
        finally:
            answer.release()

    def _put(self, req: Header, ns_id: bytes, keys: list[bytes]) -> None:
        self.receiving = True  # server.payload_stall_timeout_s applies
        try:
            stored = self._receive_put(req, ns_id, keys)
        finally:
            self.receiving = False
        self.reply(req, count=stored)

    def _receive_put(self, req: Header, ns_id: bytes, keys: list[bytes]) -> int:
        try:
            if self.traffic.draining:  # a client counts a dropped save
                raise Refused(Status.BUSY, f"node {self.store.node_id} is shutting down")
            batch = self.store.begin_put(self.session, ns_id, keys, req.payload_len)
        except Refused:
            self.discard(req.payload_len)  # the frame stays in step; then answer
            raise
        try:
            for target in batch.targets:
                if target is None:
                    self.discard(batch.ns.chunk_bytes)
                else:
                    self.recv(target)
            self.receiving = False  # all arrived; a durable commit's sync is not a stall
            return self.store.commit_put(batch)
        finally:
            batch.abort()


def _peer_name(sock: socket.socket) -> str:
    try:
        peer: Any = sock.getpeername()
        return f"{peer[0]}:{peer[1]}"
    except OSError:
        return "<unknown peer>"
