"""A storage node's TLS connections (``server.tls``): each is served from accept to close on
a thread of its own with a blocking SSL socket, as a lane serves a plain connection
(lane.py).

asyncio's ``sock_*`` calls refuse SSL sockets, and a TLS stream on the event loop would
encrypt every payload on the loop's one thread; a thread per connection keeps the loop free
and lets connections encrypt on several cores (``ssl`` releases the GIL while it works). The
plain path is untouched: the node picks this class at accept when TLS is on.

On the thread: the first byte the peer sends is peeked. A TLS handshake record is answered
with the handshake (bounded by ``server.auth_timeout_s``); a kvpool frame from a plain client
is answered BAD_REQUEST with a message naming ``cluster.tls`` and the connection closed (a
clear error for the client, not a hang); anything else is closed. Then GETs, PUTs and
existence probes are served on the thread as on a lane; every other request is answered on
the event loop (``Connection.answer``) and its answer, which ``send`` collects, is sent from
the thread.

Failure contract: as connection.py's. A failed handshake (a client certificate that does not
verify, a peer that is not a TLS client, a timeout) closes this connection only; it is
counted (``tls_handshake_failures`` in STATS) and logged rate-limited. The sweeper and the
node's stop shut the socket down (TlsSocket keeps the TLS state, so nothing is ever sent in
plain text), which ends the thread's blocking call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time
from collections.abc import Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvpool.logs import RateLimited
from kvpool.net.protocol import HEADER_BYTES, Status, answer_frame, unpack_header
from kvpool.net.tls import TlsHandshakeError
from kvpool.server.connection import Connection
from kvpool.server.lane import Lane
from kvpool.server.store import NodeStore
from kvpool.server.traffic import Traffic

log = logging.getLogger("kvpool.serve")

#: The first byte of a TLS record that carries a handshake (a ClientHello).
TLS_HANDSHAKE = 0x16
#: How long the node waits for a refused plain client to read its answer and hang up.
PLAIN_LINGER_S = 1.0
#: Buffers smaller than this are joined before a send (one TLS record for header and meta).
JOIN_BYTES = 64 << 10

_say_failed = RateLimited()


class TlsConnection(Connection):
    """One client connection over TLS; ``threads``: the node's TLS connection threads."""

    def __init__(self, store: NodeStore, traffic: Traffic, sock: socket.socket,
                 context: ssl.SSLContext, threads: ThreadPoolExecutor,
                 refusal: str | None = None) -> None:
        super().__init__(store, traffic, sock, refusal)
        self.context = context
        self.threads = threads
        #: Answers composed on the event loop, sent by the connection's thread.
        self.outbox: list[bytes] = []

    async def recv_exact(self, view: memoryview) -> None:
        raise RuntimeError("a TLS connection is read on its own thread only")

    async def send(self, buffers: Sequence[bytes | memoryview]) -> None:
        """Collect an answer composed on the loop (copied: its views may be released when
        this returns); the connection's thread sends it."""
        self.outbox.append(b"".join(bytes(b) for b in buffers))

    async def serve(self) -> None:
        """Serve on the connection's thread until the peer leaves, a frame breaks the rules,
        the handshake fails, the node drains or the sweeper cuts the peer off; never raises
        (but for cancellation)."""
        try:
            await TlsLane(self).run()
        except TlsHandshakeError as exc:
            self.count("tls_handshake_failures")
            held = _say_failed.due()
            if held is not None:
                log.info("closing %s: %s%s", self.peer, exc,
                         f" ({held} more since the last report)" if held else "",
                         extra={"event": "tls_handshake_failed", "peer": self.peer,
                                "held_back": held})
        except Exception as exc:  # never let one connection take the node down
            self.ended_by(exc)
        finally:
            self.store.close_session(self.session)


class TlsLane(Lane):
    """Serves a TlsConnection on one of the node's TLS threads (no lane is taken)."""

    PAYLOAD_RECV_FLAGS = 0

    def __init__(self, conn: TlsConnection) -> None:
        super().__init__(conn)
        self.tls_conn = conn

    async def run(self) -> None:
        """Serve on the thread and wait for it; raises what serving raised. Cancelled (the
        node stops): the socket is shut down, the thread waited for, and its exception (the
        shutdown's doing) retrieved."""
        done = asyncio.wrap_future(self.tls_conn.threads.submit(self._serve_tls))
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            await asyncio.wait([done])
            if not done.cancelled():
                done.exception()
            raise

    # ------------------------------------------------------------------ on the thread
    def _serve_tls(self) -> None:
        conn = self.tls_conn
        raw = self.sock
        raw.settimeout(conn.cfg.auth_timeout_s)  # the handshake's bound
        try:
            first = raw.recv(1, socket.MSG_PEEK)
        except TimeoutError:
            raise TlsHandshakeError("no TLS handshake within server.auth_timeout_s") from None
        if not first:
            raise ConnectionError("peer closed the connection")
        if first[0] != TLS_HANDSHAKE:
            self._refuse_plain(raw)
            return
        tls = conn.context.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
        conn.sock = self.sock = tls  # from now on the sweeper and a stop shut this one down
        try:
            tls.do_handshake()
        except (ssl.SSLError, OSError) as exc:
            if conn.cut_off is not None:
                raise
            reason = getattr(exc, "reason", None) or str(exc) or type(exc).__name__
            raise TlsHandshakeError(f"TLS handshake failed: {reason}") from None
        conn.last_io = time.monotonic()
        conn.count("tls_connections")
        self._serve()

    def _refuse_plain(self, raw: socket.socket) -> None:
        """A peer that sent something other than a TLS handshake: a kvpool frame gets a
        BAD_REQUEST answer naming cluster.tls (then the node lingers briefly for the client
        to read it and hang up); anything else is a ProtocolError."""
        conn = self.tls_conn
        header = memoryview(bytearray(HEADER_BYTES))
        got = 0
        while got < HEADER_BYTES:
            n = raw.recv_into(header[got:])
            if n == 0:
                raise ConnectionError("peer closed the connection")
            got += n
        req = unpack_header(header)  # ProtocolError unless a kvpool frame
        conn.count("tls_plain_refused")
        message = (f"node {conn.store.node_id} accepts TLS connections only: set "
                   "cluster.tls.enabled: true (and cluster.tls.ca_file)")
        raw.sendall(b"".join(bytes(b) for b in answer_frame(req, Status.BAD_REQUEST,
                                                            meta=message.encode())))
        with contextlib.suppress(OSError):
            raw.shutdown(socket.SHUT_WR)
            raw.settimeout(PLAIN_LINGER_S)
            deadline = time.monotonic() + PLAIN_LINGER_S
            while time.monotonic() < deadline and raw.recv(1 << 16):
                pass

    def _on_loop(self, answer: Coroutine[Any, Any, bool]) -> bool:
        """Answer on the event loop (the socket stays with this thread), then send what the
        answer composed from here."""
        keep = asyncio.run_coroutine_threadsafe(answer, self.conn.loop).result()
        out, self.tls_conn.outbox = self.tls_conn.outbox, []
        self._send(out)
        return keep

    def _send(self, buffers: Sequence[bytes | memoryview]) -> None:
        """Send every buffer, in order: small ones joined, large ones whole (an SSL socket
        has no sendmsg)."""
        small: list[bytes | memoryview] = []
        for buf in buffers:
            view = memoryview(buf).cast("B")
            if view.nbytes < JOIN_BYTES:
                small.append(view)
                continue
            if small:
                self.sock.sendall(b"".join(small))
                small = []
            self.sock.sendall(view)
        if small:
            self.sock.sendall(b"".join(small))
        self.conn.last_io = time.monotonic()
