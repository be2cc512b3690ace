"""Shared bits of the network tests."""

from __future__ import annotations

import os
import socket

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
