"""Shared bits of the network tests."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

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
