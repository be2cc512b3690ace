"""A storage node's TLS connections (``server.tls``): a Connection (connection.py) whose
socket is an SSL socket once the handshake is done; every request is served as on a plain
connection, on the connection's thread (``ssl`` releases the GIL while it encrypts, so
connections encrypt on several cores). The node picks this class at accept when TLS is on.

Before the first frame the first byte the peer sends is peeked. A TLS handshake record is
answered with the handshake (bounded by ``server.auth_timeout_s``); a kvpool frame from a
plain client is answered BAD_REQUEST with a message naming ``cluster.tls`` and the connection
closed (a clear error for the client, not a hang); anything else is closed. Only the socket
write differs from a plain connection: an SSL socket has no ``sendmsg``, so small buffers are
joined into one record and large ones sent whole.

Failure contract: as connection.py's. A failed handshake (a client certificate that does not
verify, a peer that is not a TLS client, a timeout) closes this connection only; it is
counted (``tls_handshake_failures`` in STATS) and logged rate-limited. The sweeper and the
node's stop shut the socket down (TlsSocket keeps the TLS state, so nothing is ever sent in
plain text), which ends the thread's blocking call.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import time

from kvpool.logs import RateLimited
from kvpool.net.protocol import HEADER_BYTES, Status, answer_frame, unpack_header
from kvpool.net.tls import TlsHandshakeError
from kvpool.server.connection import Connection
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
    """One client connection over TLS."""

    PAYLOAD_RECV_FLAGS = 0

    def __init__(self, store: NodeStore, traffic: Traffic, sock: socket.socket,
                 context: ssl.SSLContext, refusal: str | None = None) -> None:
        super().__init__(store, traffic, sock, refusal)
        self.context = context

    def ended_by(self, exc: Exception) -> None:
        """A failed handshake is counted and logged (rate-limited); anything else as on a
        plain connection."""
        if not isinstance(exc, TlsHandshakeError):
            super().ended_by(exc)
            return
        self.count("tls_handshake_failures")
        held = _say_failed.due()
        if held is not None:
            log.info("closing %s: %s%s", self.peer, exc,
                     f" ({held} more since the last report)" if held else "",
                     extra={"event": "tls_handshake_failed", "peer": self.peer,
                            "held_back": held})

    def open(self) -> bool:
        """Peek at the first byte: a TLS handshake is completed (raises TlsHandshakeError
        when it fails or takes longer than server.auth_timeout_s), a plain kvpool frame is
        refused (False)."""
        raw = self.sock
        raw.setblocking(True)
        raw.settimeout(self.cfg.auth_timeout_s)  # the handshake's bound
        try:
            first = raw.recv(1, socket.MSG_PEEK)
        except TimeoutError:
            raise TlsHandshakeError("no TLS handshake within server.auth_timeout_s") from None
        if not first:
            raise ConnectionError("peer closed the connection")
        if first[0] != TLS_HANDSHAKE:
            self._refuse_plain(raw)
            return False
        tls = self.context.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
        self.sock = tls  # from now on the sweeper and a stop shut this one down
        try:
            tls.do_handshake()
        except (ssl.SSLError, OSError) as exc:
            if self.cut_off is not None:
                raise
            reason = getattr(exc, "reason", None) or str(exc) or type(exc).__name__
            raise TlsHandshakeError(f"TLS handshake failed: {reason}") from None
        self.last_io = time.monotonic()
        self.count("tls_connections")
        return True

    def _refuse_plain(self, raw: socket.socket) -> None:
        """A peer that sent something other than a TLS handshake: a kvpool frame gets a
        BAD_REQUEST answer naming cluster.tls (then the node lingers briefly for the client
        to read it and hang up); anything else is a ProtocolError."""
        header = memoryview(bytearray(HEADER_BYTES))
        got = 0
        while got < HEADER_BYTES:
            n = raw.recv_into(header[got:])
            if n == 0:
                raise ConnectionError("peer closed the connection")
            got += n
        req = unpack_header(header)  # ProtocolError unless a kvpool frame
        self.count("tls_plain_refused")
        message = (f"node {self.store.node_id} accepts TLS connections only: set "
                   "cluster.tls.enabled: true (and cluster.tls.ca_file)")
        raw.sendall(b"".join(bytes(b) for b in answer_frame(req, Status.BAD_REQUEST,
                                                            meta=message.encode())))
        with contextlib.suppress(OSError):
            raw.shutdown(socket.SHUT_WR)
            raw.settimeout(PLAIN_LINGER_S)
            deadline = time.monotonic() + PLAIN_LINGER_S
            while time.monotonic() < deadline and raw.recv(1 << 16):
                pass

    def write(self, bufs: list[memoryview]) -> None:
        """Small buffers joined, large ones whole (an SSL socket has no sendmsg)."""
        small: list[memoryview] = []
        for view in bufs:
            if view.nbytes < JOIN_BYTES:
                small.append(view)
                continue
            if small:
                self.sock.sendall(b"".join(small))
                small = []
            self.sock.sendall(view)
        if small:
            self.sock.sendall(b"".join(small))
        self.last_io = time.monotonic()
