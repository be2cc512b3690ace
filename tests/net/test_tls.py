"""TLS between clients and storage nodes (server.tls, cluster.tls) with real ``kvpool serve``
processes and throwaway certificates (kvpool.bench.certs): data moves intact over TLS on every
path of the node (the loop's answers, the thread's GETs and PUTs), a certificate that does
not verify is refused (a miss, the node marked down; never plain text), a plain client
against a TLS node and a TLS client against a plain node fail at once with a clear error,
mutual TLS refuses a client without a certificate, and a bad key file stops the node."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from kvtest import byte_namespace, payload_for, stop_process
from node_process import NodeProcess

from kvpool.bench.certs import Certs, make_certs
from kvpool.config import ClusterConfig, ClusterTlsConfig
from kvpool.net.client import ClusterClient
from kvpool.net.connection import open_connection
from kvpool.net.protocol import RemoteError
from kvpool.net.tls import TlsHandshakeError, client_tls

CHUNK = 1 << 20  # a GET answer larger than the client's inbox: received straight
SMALL = 4 << 10  # one that fits it: received whole into the inbox, then copied out


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def tls_server(cert: Path, key: Path, **more: str) -> dict[str, object]:
    return {"tls": {"cert_file": str(cert), "key_file": str(key), **more}}


@pytest.fixture(scope="module")
def tls_node(tmp_path_factory: pytest.TempPathFactory, certs: Certs) -> Iterator[NodeProcess]:
    with NodeProcess(tmp_path_factory.mktemp("tls-node"),
                     server=tls_server(certs.node_cert, certs.node_key)) as node:
        yield node


def client_cfg(node: NodeProcess, ca: Path, **tls: object) -> ClusterConfig:
    return ClusterConfig(nodes=[node.address], retry_down_s=0.2, request_timeout_s=5,
                         tls=ClusterTlsConfig(enabled=True, ca_file=str(ca), **tls))


def test_data_moves_intact_over_tls(tls_node: NodeProcess, certs: Certs) -> None:
    ns = byte_namespace(CHUNK, salt="tls")
    keys = ns.chunk_keys(list(range(6)))
    client = ClusterClient(client_cfg(tls_node, certs.ca))
    try:
        client.register_namespace(ns)
        assert client.put_many([(k, ns, payload_for(k, CHUNK)) for k in keys]) == len(keys)
        for _ in range(3):
            outs = [np.zeros(CHUNK, np.uint8) for _ in keys]
            assert client.get_many_into(ns, keys, outs) == [True] * len(keys)
            for key, out in zip(keys, outs, strict=True):
                assert np.array_equal(out, payload_for(key, CHUNK))
        small = byte_namespace(SMALL, salt="tls-small")
        client.register_namespace(small)
        assert client.put_many([(k, small, payload_for(k, SMALL)) for k in keys[:4]]) == 4
        outs = [np.zeros(SMALL, np.uint8) for _ in keys]
        assert client.get_many_into(small, keys, outs) == [True] * 4 + [False] * 2
        for key, out in zip(keys[:4], outs[:4], strict=True):
            assert np.array_equal(out, payload_for(key, SMALL))
    finally:
        client.close()
    conn = open_connection(tls_node.address, tls=client_tls(client_cfg(tls_node, certs.ca).tls))
    try:
        server = conn.stats()["server"]
        assert server["tls_connections"] >= 2
        assert conn.delete(ns, keys[:2]) == 2
        assert conn.exists(ns, keys) == [False, False] + [True] * 4
    finally:
        conn.close()


def test_a_node_whose_certificate_does_not_verify_is_refused(tmp_path: Path,
                                                             certs: Certs) -> None:
    """A node with a certificate of another CA: the handshake fails with the reason, the
    node is marked down and reads are misses; no request is sent in plain text."""
    with NodeProcess(tmp_path / "rogue",
                     server=tls_server(certs.rogue_node_cert, certs.rogue_node_key)) as rogue:
        with pytest.raises(TlsHandshakeError, match="certificate verify failed"):
            open_connection(rogue.address, tls=client_tls(client_cfg(rogue, certs.ca).tls))
        ns = byte_namespace(CHUNK, salt="rogue")
        keys = ns.chunk_keys([1, 2])
        client = ClusterClient(client_cfg(rogue, certs.ca))
        try:
            client.register_namespace(ns)
            outs = [np.zeros(CHUNK, np.uint8) for _ in keys]
            assert client.get_many_into(ns, keys, outs) == [False, False]
            assert client.live_nodes() == []  # marked down
            assert client.stats()["node_failures"] >= 1
        finally:
            client.close()
        # The node saw handshakes fail, never a request (rogue CA, hostname unchecked).
        trusting = client_tls(ClusterTlsConfig(enabled=True, ca_file=str(certs.rogue_ca)))
        conn = open_connection(rogue.address, tls=trusting)
        try:
            server = conn.stats()["server"]
        finally:
            conn.close()
        assert server["tls_handshake_failures"] >= 2
        assert server.get("op_namespace", 0) == 0 and server.get("op_get", 0) == 0


def test_a_name_that_does_not_match_is_refused(tls_node: NodeProcess, certs: Certs) -> None:
    with pytest.raises(TlsHandshakeError, match="certificate verify failed"):
        open_connection(tls_node.address, tls=client_tls(
            client_cfg(tls_node, certs.ca, server_name="other.example").tls))
    loose = client_tls(client_cfg(tls_node, certs.ca, server_name="other.example",
                                  check_hostname=False).tls)
    open_connection(tls_node.address, tls=loose).close()


def test_a_plain_client_gets_a_clear_error_not_a_hang(tls_node: NodeProcess,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    started = time.monotonic()
    with pytest.raises(RemoteError, match=r"accepts TLS connections only.*cluster\.tls"):
        open_connection(tls_node.address, request_timeout=10).ping()
    assert time.monotonic() - started < 5
    ns = byte_namespace(CHUNK, salt="plain")
    client = ClusterClient(ClusterConfig(nodes=[tls_node.address], request_timeout_s=10))
    try:  # through the cluster client: misses, and the reason in its log
        client.register_namespace(ns)
        outs = [np.zeros(CHUNK, np.uint8)]
        assert client.get_many_into(ns, ns.chunk_keys([7]), outs) == [False]
    finally:
        client.close()
    assert time.monotonic() - started < 10
    assert "accepts TLS connections only" in caplog.text


def test_a_tls_client_against_a_plain_node_fails_at_once(node: NodeProcess,
                                                         certs: Certs) -> None:
    started = time.monotonic()
    with pytest.raises(TlsHandshakeError, match=node.address):
        open_connection(node.address, request_timeout=10,
                        tls=client_tls(client_cfg(node, certs.ca).tls))
    assert time.monotonic() - started < 5


def test_mutual_tls_requires_a_client_certificate(tmp_path: Path, certs: Certs) -> None:
    server = tls_server(certs.node_cert, certs.node_key, client_ca_file=str(certs.ca))
    with NodeProcess(tmp_path / "mtls", server=server) as node:
        anonymous = client_tls(client_cfg(node, certs.ca).tls)
        with pytest.raises(OSError):  # TLS 1.3: the node's alert arrives at the first read
            open_connection(node.address, tls=anonymous).ping()
        signed = client_tls(client_cfg(node, certs.ca, cert_file=str(certs.client_cert),
                                       key_file=str(certs.client_key)).tls)
        conn = open_connection(node.address, tls=signed)
        try:
            conn.ping()
        finally:
            conn.close()


def test_a_key_that_cannot_be_loaded_stops_serve(tmp_path: Path, certs: Certs) -> None:
    node = NodeProcess(tmp_path / "bad", server=tls_server(certs.node_cert,
                                                          tmp_path / "missing.key"))
    with pytest.raises(RuntimeError, match=r"exited \(2\).*server\.tls\.cert_file"):
        node.start()


def test_sigterm_with_tls_clients_connected_exits_cleanly(tmp_path: Path,
                                                          certs: Certs) -> None:
    with NodeProcess(tmp_path / "stop",
                     server=tls_server(certs.node_cert, certs.node_key)) as node:
        tls = client_tls(client_cfg(node, certs.ca).tls)
        conns = [open_connection(node.address, tls=tls) for _ in range(3)]
        for conn in conns:
            conn.ping()
        started = time.monotonic()
        assert node.terminate(20) == 0
        assert time.monotonic() - started < 15
        for conn in conns:
            conn.close()
    assert "Traceback" not in node.log.read_text()


def test_a_stopped_tls_node_times_out_not_hangs(tmp_path: Path, certs: Certs) -> None:
    """Python's socket timeouts bound TLS reads (a kernel SO_RCVTIMEO would make a blocking
    SSL read retry forever)."""
    with NodeProcess(tmp_path / "stopped",
                     server=tls_server(certs.node_cert, certs.node_key)) as node:
        conn = open_connection(node.address, request_timeout=1.0,
                               tls=client_tls(client_cfg(node, certs.ca).tls))
        assert node.proc is not None
        try:
            stop_process(node.proc.pid)
            started = time.monotonic()
            with pytest.raises(TimeoutError, match="moved nothing"):
                conn.ping()
            assert time.monotonic() - started < 5
        finally:
            node.proc.send_signal(signal.SIGCONT)
            conn.close()
