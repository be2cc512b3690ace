"""Shared bits of the network tests."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable

from kvpool.net.protocol import FEATURES, HEADER_BYTES, RESPONSE_BIT, Header, Op, unpack_header

KEYS = [os.urandom(16) for _ in range(16)]


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes off ``sock``; ConnectionError if the node closes it first."""
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("node closed the connection")
        buf += part
    return bytes(buf)


def wait_until(check: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    """Poll ``check`` every 50 ms until it is true or ``timeout_s`` passes; its last answer
    (unlike kvtest.wait_for, which raises)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


#: A GET's header -> the pieces a ScriptedPeer sends; a last piece b"" closes the connection.
Script = Callable[[Header], list[bytes]]


class ScriptedPeer:
    """A node impostor on a real listening socket: each connection answers NAMESPACE with
    ``ns_id`` (and every Feature) and any other request with the next queued script, piece
    by piece (``sendall`` each). For tests of the client's receive of bad answers."""

    def __init__(self, ns_id: bytes = bytes(16)) -> None:
        self.ns_id = ns_id
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.scripts: list[Script] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        with sock:
            while True:
                try:
                    req = unpack_header(recv_exact(sock, HEADER_BYTES))
                    recv_exact(sock, req.meta_len)
                except (ConnectionError, OSError):
                    return
                if req.op == Op.NAMESPACE:
                    sock.sendall(Header(req.op | RESPONSE_BIT, req.req_id, int(FEATURES),
                                        len(self.ns_id), 0).pack() + self.ns_id)
                    continue
                for piece in self.scripts.pop(0)(req):
                    if not piece:
                        return  # closes
                    try:
                        sock.sendall(piece)
                    except OSError:  # the client gave up on a bad answer and closed
                        return

    def close(self) -> None:
        self.listener.close()
