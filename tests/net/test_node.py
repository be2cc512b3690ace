"""One real storage node: operations, auth, limits, restart after kill -9, SIGTERM drain."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvtest import byte_namespace, payload_for
from node_process import NodeProcess

from kvpool.config import ClusterConfig
from kvpool.keys import Namespace
from kvpool.net.client import ClusterClient
from kvpool.net.connection import NodeConnection
from kvpool.net.protocol import HEADER_BYTES, AuthError, Header, Op, RemoteError, Status

CHUNK = 256 * 1024


def client_for(node: NodeProcess, token: str | None = None, **kw: Any) -> ClusterClient:
    return ClusterClient(ClusterConfig(nodes=[node.address], token=token, **kw))


def stored(client: ClusterClient, ns_salt: str, n: int) -> tuple[Namespace, list[bytes]]:
    ns = byte_namespace(CHUNK, salt=ns_salt)
    client.register_namespace(ns)
    keys = [os.urandom(16) for _ in range(n)]
    assert client.put_many([(k, ns, payload_for(k, CHUNK)) for k in keys]) == n
    return ns, keys


def fetch(client: ClusterClient, ns: Namespace,
          keys: list[bytes]) -> tuple[list[bool], list[np.ndarray]]:
    outs = [np.zeros(CHUNK, np.uint8) for _ in keys]
    return client.get_many_into(ns, keys, outs), outs


def test_put_get_exists_delete_invalidate(auth_node: NodeProcess) -> None:
    client = client_for(auth_node, "token-acme-123")
    ns, keys = stored(client, "acme", 6)
    assert client.exists_prefix(ns, keys) == 6
    assert client.exists_prefix(ns, [*keys[:2], os.urandom(16), *keys[3:]]) == 2
    found, outs = fetch(client, ns, [*keys, os.urandom(16)])
    assert found == [True] * 6 + [False]
    for key, out in zip(keys, outs, strict=False):
        assert np.array_equal(out, payload_for(key, CHUNK))
    assert client.delete(ns, keys[:1]) == 1
    assert fetch(client, ns, keys[:2])[0] == [False, True]
    assert client.invalidate(ns) >= 5
    assert client.exists_prefix(ns, keys[1:]) == 0
    client.close()


def test_wrong_token_missing_token_and_foreign_tenant_are_refused(auth_node: NodeProcess) -> None:
    ns = byte_namespace(CHUNK, salt="acme")
    with pytest.raises(AuthError, match="AUTH_FAILED"):
        client_for(auth_node, "not-a-token").register_namespace(ns)
    with pytest.raises(AuthError, match="AUTH_REQUIRED"):
        client_for(auth_node, None).register_namespace(ns)
    with pytest.raises(AuthError, match=r"FORBIDDEN.*'acme'"):
        client_for(auth_node, "token-beta-456").register_namespace(ns)
    # The same refusals on a raw connection: the node answers, then closes only that socket.
    conn = NodeConnection(auth_node.address)
    with pytest.raises(AuthError, match="AUTH_REQUIRED"):
        conn.ping()
    with pytest.raises(ConnectionError):
        conn.ping()
    conn.close()


def test_a_key_presented_under_another_tenant_never_reads_its_bytes(auth_node: NodeProcess) -> None:
    acme = client_for(auth_node, "token-acme-123")
    _, keys = stored(acme, "acme:secret-salt", 3)
    beta = client_for(auth_node, "token-beta-456")
    beta_ns = byte_namespace(CHUNK, salt="beta")
    beta.register_namespace(beta_ns)
    assert beta.exists_prefix(beta_ns, keys) == 0
    assert fetch(beta, beta_ns, keys)[0] == [False] * 3
    # A token granted both tenants reaches each namespace by its own id only.
    both = client_for(auth_node, "token-both-789")
    acme_ns = byte_namespace(CHUNK, salt="acme:secret-salt")
    both.register_namespace(acme_ns)
    assert both.exists_prefix(acme_ns, keys) == 3


def test_an_answer_over_the_inflight_limit_is_refused_and_the_connection_survives(
        tmp_path: Path) -> None:
    node = NodeProcess(tmp_path / "n", server={"max_inflight_bytes": 4 * CHUNK})
    node.start()
    try:
        conn = NodeConnection(node.address)
        ns = byte_namespace(CHUNK)
        keys = [os.urandom(16) for _ in range(5)]
        with pytest.raises(RemoteError, match="TOO_LARGE"):
            conn.get_into(ns, keys, [np.zeros(CHUNK, np.uint8) for _ in keys])
        assert conn.get_into(ns, keys[:4], [np.zeros(CHUNK, np.uint8) for _ in range(4)]) == \
            [False] * 4
        conn.close()
        # The cluster client splits big batches itself, so users never meet the limit.
        client = client_for(node)
        client.register_namespace(ns)
        assert client.put_many([(k, ns, payload_for(k, CHUNK)) for k in keys]) == 5
        conn = NodeConnection(node.address)
        with pytest.raises(RemoteError, match="UNKNOWN_NAMESPACE"):
            conn.call(Op.EXISTS_PREFIX, 1, ns.id + keys[0])
        conn.ping()
    finally:
        node.stop()


def test_client_requests_carry_at_most_batch_bytes_on_tuned_sockets(tmp_path: Path) -> None:
    """cluster.batch_bytes splits a PUT / GET into requests of that much payload (a node
    closes the connection on a frame over server.max_frame_bytes, so one unsplit 5-chunk PUT
    is lost); cluster.socket_buffer_bytes sizes the client's socket buffers."""
    node = NodeProcess(tmp_path / "n", server={"max_frame_bytes": 3 * CHUNK,
                                               "max_inflight_bytes": 2 * CHUNK})
    node.start()
    try:
        ns = byte_namespace(CHUNK)
        keys = [os.urandom(16) for _ in range(5)]
        items = [(k, ns, payload_for(k, CHUNK)) for k in keys]
        unsplit = client_for(node)
        unsplit.register_namespace(ns)
        assert unsplit.put_many(items) == 0  # one 5-chunk frame: refused
        unsplit.close()
        client = client_for(node, batch_bytes=2 * CHUNK, socket_buffer_bytes=96 << 10)
        client.register_namespace(ns)
        assert client.put_many(items) == 5
        found, outs = fetch(client, ns, keys)
        assert found == [True] * 5
        assert all(np.array_equal(o, payload_for(k, CHUNK)) for k, o in zip(keys, outs,
                                                                             strict=True))
        (pool,) = client._pools.values()
        with pool.connection() as conn:  # Linux reports twice the size asked for
            assert conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) == 2 * (96 << 10)
        client.close()
    finally:
        node.stop()


def wait_written(client: ClusterClient, timeout_s: float = 20.0) -> None:
    """Until the node's write-behind queue to its SSD is empty."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = next(iter(client.node_stats().values()))
        if stats is not None and stats["write_behind"]["queued"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError("node did not write its chunks to SSD")


def test_node_killed_with_sigkill_serves_its_ssd_data_after_restart(node: NodeProcess) -> None:
    client = client_for(node, retry_down_s=0.2)
    ns, keys = stored(client, "", 40)  # 10 MiB: more than fits once in... all on SSD anyway
    wait_written(client)
    node.kill9()
    found, _ = fetch(client, ns, keys)
    assert found == [False] * 40  # a dead node is a miss, not an error
    assert client.stats()["down_nodes"] == [node.address]
    node.start()
    time.sleep(0.3)  # past retry_down_s: the next request is the probe
    found, outs = fetch(client, ns, keys)
    assert found == [True] * 40
    assert all(np.array_equal(o, payload_for(k, CHUNK)) for k, o in zip(keys, outs, strict=True))
    stats = next(iter(client.node_stats().values()))
    assert stats is not None and stats["ssd"]["hits"] >= 40
    client.close()


def test_a_served_node_keeps_its_startup_heap_out_of_garbage_collections(
        node: NodeProcess) -> None:
    """``kvpool serve`` freezes what it built at start (~45k objects: modules, config, tiers),
    so no full collection pauses requests to scan them; it still serves afterwards."""
    client = client_for(node)
    ns, keys = stored(client, "", 4)
    found, outs = fetch(client, ns, keys)
    assert found == [True] * 4
    assert all(np.array_equal(o, payload_for(k, CHUNK)) for k, o in zip(keys, outs, strict=True))
    stats = next(iter(client.node_stats().values()))
    assert stats is not None and stats["server"]["gc_frozen_objects"] > 10_000
    client.close()


def test_sigterm_drains_write_behind_before_exit(node: NodeProcess) -> None:
    client = client_for(node)
    ns, keys = stored(client, "", 120)  # 30 MiB queued for the SSD
    assert node.terminate() == 0
    assert "stopped" in node.proc.stdout.read()
    node.start()
    client = client_for(node)
    client.register_namespace(ns)
    found, outs = fetch(client, ns, keys)
    assert found == [True] * 120
    assert all(np.array_equal(o, payload_for(k, CHUNK)) for k, o in zip(keys, outs, strict=True))


def test_serve_on_a_busy_port_fails_clearly(node: NodeProcess, tmp_path: Path) -> None:
    cfg = tmp_path / "busy.yaml"
    cfg.write_text(f"cache_dir: {tmp_path}/c2\nserver: {{port: {node.port}}}\n")
    out = subprocess.run([sys.executable, "-m", "kvpool.cli", "serve", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "cannot start" in out.stderr


def test_raw_frames_get_answers_with_matching_ids(node: NodeProcess) -> None:
    with socket.create_connection(("127.0.0.1", node.port)) as sock:
        sock.sendall(Header(Op.PING, 77, 0, 0, 0).pack() + Header(Op.PING, 78, 0, 0, 0).pack())
        raw = b""
        while len(raw) < 2 * HEADER_BYTES:
            raw += sock.recv(4096)
    from kvpool.net.protocol import unpack_header
    a, b = unpack_header(raw[:32]), unpack_header(raw[32:64])
    assert (a.req_id, b.req_id, a.status, a.is_response) == (77, 78, Status.OK, True)


@pytest.mark.parametrize(("cache_s", "back"), [(0.0, True), (3600.0, False)])
def test_live_cache_s_is_how_long_the_live_node_list_is_reused(cache_s: float,
                                                               back: bool) -> None:
    """A node marked down leaves the live list at once; cluster.live_cache_s is how long a
    computed list is then reused, so a node whose retry time has come is back only once the
    list is recomputed."""
    with socket.socket() as probe:  # a port nothing listens on: every connect is refused
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    client = ClusterClient(ClusterConfig(nodes=[address], retry_down_s=0.05,
                                         live_cache_s=cache_s))
    (node_id,) = client.live_nodes()
    ns = byte_namespace(CHUNK)
    assert client.put_many([(os.urandom(16), ns, payload_for(b"x" * 16, CHUNK))]) == 0
    assert client.live_nodes() == []
    time.sleep(0.1)  # past retry_down_s
    assert client.live_nodes() == ([node_id] if back else [])
    client.close()
