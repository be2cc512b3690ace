"""Helpers of the node lifecycle tests (tests/net/test_node_signals.py,
tests/cluster/test_node_lifecycle_etcd.py): a metrics-port page, a request left in flight,
the lines a clean stop must not log."""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request

from kvtest import byte_namespace

from kvpool.net.connection import NodeConnection
from kvpool.net.protocol import Header, Op, pack_keys

CHUNK = 64 << 10
NS = byte_namespace(CHUNK, salt="signals")


def bad_lines(text: str) -> list[str]:
    """ERROR lines and tracebacks, text or JSON."""
    return [line for line in text.splitlines()
            if " ERROR " in line or "Traceback" in line or '"level": "error"' in line]


def http(port: int, path: str) -> tuple[int, str]:
    """Status and body of http://127.0.0.1:port/path (error statuses included)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def start_partial_put(address: str) -> NodeConnection:
    """A connection whose PUT sent its header, keys and half its payload: a request in
    flight on the node until the rest comes (it never does). Returns once the node counts it
    in flight (its connection's thread has taken the header): a stop that comes after it
    waits for it."""
    conn = NodeConnection(address)
    conn.declare(NS)
    meta = pack_keys(NS.id, [os.urandom(16)])
    head = Header(Op.PUT, 4242, 1, len(meta), CHUNK).pack()
    conn.sock.sendall(head + meta + bytes(CHUNK // 2))
    probe = NodeConnection(address)
    try:  # the STATS request is in flight too while it is answered
        deadline = time.monotonic() + 30
        while probe.stats()["server"]["inflight_requests"] < 2:
            assert time.monotonic() < deadline, "the node never took the partial PUT"
            time.sleep(0.01)
    finally:
        probe.close()
    return conn
