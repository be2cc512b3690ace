"""A node under resource pressure: out of descriptors, over max_connections, peers that never
AUTH, and a flood of namespace declares. Real nodes, real sockets."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvtest import byte_namespace, payload_for
from node_process import NodeProcess
from tests_support import recv_exact, wait_until

from kvpool.keys import Namespace, canonical_json
from kvpool.net.connection import NodeConnection
from kvpool.net.protocol import HEADER_BYTES, Header, Op, RemoteError, Status, unpack_header

CHUNK = 64 * 1024
TOKENS = [{"token": "token-acme-123", "tenants": ["acme"]}]
ADMIN = "admin-token-000"


def server_stats(node: NodeProcess, token: str | None = None) -> dict[str, Any]:
    conn = NodeConnection(node.address, token=token)
    try:
        stats: dict[str, Any] = conn.stats()["server"]
        return stats
    finally:
        conn.close()


@pytest.fixture
def limited_node(tmp_path: Path) -> Iterator[NodeProcess]:
    """Auth on (TOKENS and an admin token), at most 500 namespaces."""
    with NodeProcess(tmp_path / "n", server={"auth": TOKENS, "admin_token": ADMIN,
                                             "max_namespaces": 500}) as node:
        yield node


@pytest.fixture
def auth_only_node(tmp_path: Path) -> Iterator[NodeProcess]:
    """Auth on, every limit at its default (server.auth_timeout_s: 5 s)."""
    with NodeProcess(tmp_path / "n", server={"auth": TOKENS}) as node:
        yield node


def test_a_node_out_of_descriptors_serves_again_once_they_are_freed(tmp_path: Path) -> None:
    # soft = hard = 128: raising the soft limit at start cannot help.
    node = NodeProcess(tmp_path / "n", fd_limit=128)
    node.start()
    try:
        socks = [socket.create_connection(("127.0.0.1", node.port)) for _ in range(200)]
        try:  # until the node has run out of descriptors (its log says so)
            wait_until(lambda: "EMFILE" in node.log.read_text(), timeout_s=10.0)
        finally:
            for sock in socks:
                sock.close()
        conn = NodeConnection(node.address, request_timeout=10.0)
        conn.ping()  # today's main: the accept loop died on EMFILE, this times out
        assert conn.stats()["server"]["accept_errors"] >= 1
        conn.close()
        log = node.log.read_text()
        assert log.count("accept failed: EMFILE") == 1  # once per burst
        assert "fd limit: 128 open files (hard limit 128)" in log
    finally:
        node.stop()


def test_a_connection_over_max_connections_gets_busy_and_the_others_keep_working(
        tmp_path: Path) -> None:
    node = NodeProcess(tmp_path / "n", server={"max_connections": 2})
    node.start()
    try:
        served = [NodeConnection(node.address) for _ in range(2)]
        for conn in served:
            conn.ping()
        extra = NodeConnection(node.address)
        with pytest.raises(RemoteError, match=r"BUSY.*max_connections=2"):
            extra.ping()
        with pytest.raises(OSError):  # then it is closed
            extra.ping()
        extra.close()
        served[0].ping()
        served.pop().close()

        def one_more() -> bool:
            conn = NodeConnection(node.address)
            try:
                conn.ping()
                return True
            except RemoteError:
                return False
            finally:
                conn.close()

        assert wait_until(one_more)
        assert served[0].stats()["server"]["connections_refused"] >= 1
        served[0].close()
        assert "refusing connections over server.max_connections=2" in node.log.read_text()
    finally:
        node.stop()


def test_a_peer_that_trickles_bytes_without_auth_is_closed_at_the_deadline(
        auth_only_node: NodeProcess) -> None:
    authed = NodeConnection(auth_only_node.address, token="token-acme-123")
    with socket.create_connection(("127.0.0.1", auth_only_node.port)) as sock:
        # An AUTH whose 60,000-byte token arrives one byte every 0.5 s: no frame ever
        # completes and the connection is never idle (idle_timeout_s is 300 s).
        sock.sendall(Header(Op.AUTH, 1, 0, 60_000, 0).pack())
        sock.settimeout(0.5)
        closed = False
        for _ in range(60):  # 30 s
            try:
                sock.sendall(b"K")
                closed = sock.recv(1) == b""
            except TimeoutError:
                continue
            except OSError:
                closed = True
            if closed:
                break
        assert closed, "an unauthenticated trickling peer kept its connection"
    authed.ping()  # past the deadline too: an authenticated connection is not cut off
    authed.close()


def declare_many(address: str, token: str, namespaces: list[Namespace]) -> list[int]:
    """Pipelined NAMESPACE requests on one connection; the status of each answer."""
    conn = NodeConnection(address, token=token)
    try:
        frames = b"".join(Header(Op.NAMESPACE, i, 0, len(m), 0).pack() + m
                          for i, m in enumerate(canonical_json(ns.canonical())
                                                for ns in namespaces))
        conn.sock.sendall(frames)
        statuses = []
        for _ in namespaces:
            head = unpack_header(recv_exact(conn.sock, HEADER_BYTES))
            recv_exact(conn.sock, head.meta_len)
            statuses.append(head.status)
        return statuses
    finally:
        conn.close()


def test_40k_namespace_declares_keep_the_registry_at_its_bound(
        limited_node: NodeProcess) -> None:
    token = "token-acme-123"
    kept = byte_namespace(CHUNK, salt="acme:kept")
    keys = [os.urandom(16) for _ in range(4)]
    writer = NodeConnection(limited_node.address, token=token)
    assert writer.put(kept, keys, [payload_for(k, CHUNK) for k in keys]) == 4
    writer.close()
    rss_before = limited_node.rss_bytes()
    total, per_connection = 40_000, 250
    for start in range(0, total, per_connection):
        batch = [byte_namespace(CHUNK, salt=f"acme:{i}")
                 for i in range(start, start + per_connection)]
        assert declare_many(limited_node.address, token, batch) == [Status.OK] * len(batch)
    server = server_stats(limited_node, ADMIN)
    assert server["namespaces"] <= server["namespaces_limit"] == 500
    assert server["namespaces_forgotten"] >= total - 500
    print(f"\n40,000 declares: registry {server['namespaces']} namespaces, "
          f"RSS {(limited_node.rss_bytes() - rss_before) / 2**20:+.1f} MiB")
    # A forgotten namespace serves its chunks again once declared.
    reader = NodeConnection(limited_node.address, token=token)
    outs = [np.zeros(CHUNK, np.uint8) for _ in keys]
    assert reader.get_into(kept, keys, outs) == [True] * 4
    assert all(np.array_equal(o, payload_for(k, CHUNK)) for k, o in zip(keys, outs, strict=True))
    reader.close()


def test_a_new_namespace_is_refused_busy_when_every_registered_one_is_in_use(
        limited_node: NodeProcess) -> None:
    holders = [NodeConnection(limited_node.address, token="token-acme-123") for _ in range(2)]
    for h, holder in enumerate(holders):
        for i in range(250):
            holder.declare(byte_namespace(CHUNK, salt=f"acme:held-{h}-{i}"))
    extra = NodeConnection(limited_node.address, token="token-acme-123")
    with pytest.raises(RemoteError, match=r"BUSY.*max_namespaces=500"):
        extra.declare(byte_namespace(CHUNK, salt="acme:one-too-many"))
    extra.ping()  # refused, not closed
    holders.pop().close()
    assert wait_until(lambda: _declares(extra, byte_namespace(CHUNK, salt="acme:later")))
    extra.close()
    holders[0].close()


def _declares(conn: NodeConnection, ns: Namespace) -> bool:
    try:
        conn.declare(ns)
        return True
    except RemoteError:
        return False
