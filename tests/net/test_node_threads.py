"""A thread per connection (server/connection.py): every op answers on the connection's
thread, lower-tier reads included; refusals keep the connection; idle and stalled peers are
cut off by the sweeper (which shuts the socket down under the thread's blocking call); a bad
frame closes that connection only; a node stops with connections busy or idle; pipelined
frames are each answered in order."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvtest import byte_namespace, payload_for, wait_for
from node_process import NodeProcess
from tests_support import recv_exact

from kvpool.net.connection import NodeConnection
from kvpool.net.protocol import HEADER_BYTES, Op, RemoteError, pack_keys

MiB = 1 << 20
CHUNK = MiB
NS = byte_namespace(CHUNK, salt="threads")
HANG_S = 60.0  # only a hang detector


def alone(address: str) -> bool:
    """Only the asking connection is open (every other one's thread has ended)."""
    return bool(server_stats(address)["connections"] == 1)


def server_stats(address: str) -> dict[str, Any]:
    conn = NodeConnection(address)
    try:
        stats: dict[str, Any] = conn.stats()["server"]
        return stats
    finally:
        conn.close()


def put(conn: NodeConnection, n: int) -> list[bytes]:
    """Store ``n`` fresh chunks, 4 per PUT."""
    keys = [os.urandom(16) for _ in range(n)]
    for i in range(0, n, 4):
        part = keys[i:i + 4]
        assert conn.put(NS, part, [payload_for(k, CHUNK) for k in part]) == len(part)
    return keys


def check_get(conn: NodeConnection, keys: list[bytes]) -> None:
    outs = [np.zeros(CHUNK, np.uint8) for _ in keys]
    assert conn.get_into(NS, keys, outs) == [True] * len(keys)
    for key, out in zip(keys, outs, strict=True):
        assert np.array_equal(out, payload_for(key, CHUNK))


def connected(address: str) -> tuple[NodeConnection, list[bytes]]:
    """A connection that has stored two chunks and read them back."""
    conn = NodeConnection(address)
    keys = put(conn, 2)
    check_get(conn, keys)
    return conn, keys


def test_every_op_answers_on_the_connection_thread(tmp_path: Path) -> None:
    with NodeProcess(tmp_path, dram={"capacity": "16MiB", "slab_size": "4MiB"},
                     ssd={"capacity": "256MiB", "segment_size": "8MiB"},
                     server={"max_inflight_bytes": "8MiB"}) as node:
        conn, first = connected(node.address)
        assert conn.stats()["server"]["connections"] == 1
        keys = first + put(conn, 38)  # 40 MiB: most of it only on the SSD now
        for i in range(0, len(keys), 8):  # 8 chunks per GET, the first ones read from SSD
            check_get(conn, keys[i:i + 8])
        absent = os.urandom(16)
        outs = [np.zeros(CHUNK, np.uint8) for _ in range(3)]
        assert conn.get_into(NS, [keys[0], absent, keys[1]], outs) == [True, False, True]
        assert np.array_equal(outs[2], payload_for(keys[1], CHUNK))
        assert conn.exists(NS, [keys[0], absent]) == [True, False]
        assert conn.exists_prefix(NS, [keys[0], keys[1], absent]) == 2
        assert conn.touch(NS, [keys[2], absent]) == 1
        with pytest.raises(RemoteError, match="max_inflight_bytes"):
            conn.get_into(NS, keys[:9], [np.zeros(CHUNK, np.uint8) for _ in range(9)])
        other = byte_namespace(CHUNK, salt="threads-undeclared")
        with pytest.raises(RemoteError, match="not declared"):
            conn._request(Op.GET, 1, pack_keys(other.id, [keys[0]]))
            conn._answer(Op.GET, conn._req_id)
        with pytest.raises(RemoteError, match="not declared"):  # a probe
            conn._request(Op.EXISTS, 1, pack_keys(other.id, [keys[0]]))
            conn._answer(Op.EXISTS, conn._req_id)
        with pytest.raises(RemoteError, match="not declared"):  # its payload is read away
            conn.call(Op.PUT, 2, pack_keys(other.id, keys[:2]),
                      [memoryview(payload_for(k, CHUNK)) for k in keys[:2]])
        assert conn.delete(NS, [keys[3]]) == 1
        assert conn.get_into(NS, [keys[3]], outs[:1]) == [False]
        check_get(conn, keys[4:6])  # the connection survived every refusal
        stats = conn.stats()["server"]
        assert stats["refused_too_large"] == 1 and stats["refused_unknown_namespace"] == 3
        conn.close()
        wait_for(lambda: alone(node.address), HANG_S, "the connection's thread to end")


def test_an_idle_connection_is_cut_off_and_a_bad_frame_closes_only_its_connection(
        tmp_path: Path) -> None:
    with NodeProcess(tmp_path, server={"idle_timeout_s": 1.0}) as node:
        idle, _ = connected(node.address)
        bad, _ = connected(node.address)
        bad.sock.sendall(b"\xff" * HEADER_BYTES)  # not a frame
        assert bad.sock.recv(16) == b""  # closed by the node
        wait_for(lambda: server_stats(node.address).get("idle_closed", 0) >= 1, HANG_S,
                 "the idle cut-off")
        with pytest.raises((ConnectionError, OSError)):
            idle.ping()
        stats = server_stats(node.address)
        assert stats["protocol_errors"] == 1
        wait_for(lambda: alone(node.address), HANG_S, "both threads to end")
        conn, keys = connected(node.address)  # the node serves new connections
        check_get(conn, keys)
        conn.close()
        idle.close()
        bad.close()


def stall(conn: NodeConnection, keys: list[bytes]) -> None:
    """Ask for more than the socket buffers hold and read none of it: the connection's
    thread blocks in its send."""
    conn._request(Op.GET, len(keys), pack_keys(NS.id, keys))


def test_a_peer_that_stops_reading_an_answer_is_cut_off(tmp_path: Path) -> None:
    with NodeProcess(tmp_path, server={"idle_timeout_s": 1.0}) as node:
        conn, _ = connected(node.address)
        keys = put(conn, 40)
        stall(conn, keys)
        wait_for(lambda: server_stats(node.address).get("idle_closed", 0) >= 1, HANG_S,
                 "the stall cut-off")
        wait_for(lambda: alone(node.address), HANG_S, "the thread to end")
        fresh, _ = connected(node.address)
        check_get(fresh, keys[:4])
        fresh.close()
        conn.close()


def test_a_node_stops_with_connections_idle_and_stalled(tmp_path: Path) -> None:
    node = NodeProcess(tmp_path, server={"shutdown_timeout_s": 1.0}).start()
    try:
        idle, _ = connected(node.address)
        stalled, _ = connected(node.address)
        stall(stalled, put(stalled, 40))
        assert node.terminate(HANG_S) == 0
        with pytest.raises((ConnectionError, OSError)):
            idle.ping()
        idle.close()
        stalled.close()
    finally:
        node.stop()


def test_every_kind_of_request_interleaves_on_one_connection(tmp_path: Path) -> None:
    """NAMESPACE and TOUCH between the PUTs, GETs and probes of one connection."""
    with NodeProcess(tmp_path) as node:
        conn, keys = connected(node.address)
        for i in range(20):
            keys += put(conn, 1)
            check_get(conn, keys[-2:])
            conn.declared.clear()  # declare again: NAMESPACE between GETs
            assert conn.exists(NS, keys[i:i + 2]) == [True, True]
            assert conn.touch(NS, keys[i:i + 2]) == 2
        conn.close()


def test_acknowledged_puts_survive_kill_9_of_a_durable_node(tmp_path: Path) -> None:
    """A durable PUT is written and synced on the connection's thread before its answer."""
    node = NodeProcess(tmp_path, ssd={"durability": "durable", "capacity": "128MiB"}).start()
    try:
        conn, acked = connected(node.address)
        acked += put(conn, 20)
        node.kill9()  # right after the last answer
        conn.close()
        node.start()
        fresh = NodeConnection(node.address)
        for i in range(0, len(acked), 4):
            check_get(fresh, acked[i:i + 4])
        fresh.close()
    finally:
        node.stop()


def _read_answer(conn: NodeConnection) -> tuple[Any, bytes, bytes]:
    """One answer frame off the raw socket: (header, metadata, payload)."""
    from kvpool.net.protocol import unpack_header

    head = unpack_header(recv_exact(conn.sock, HEADER_BYTES))
    return head, recv_exact(conn.sock, head.meta_len), recv_exact(conn.sock, head.payload_len)


def test_pipelined_frames_are_each_answered_in_order(tmp_path: Path) -> None:
    """A connection receives a request's header, keys and the start of its payload in one
    receive: whatever came with them (the next requests, sent before any answer) is kept for
    the next read, and a PUT's payload is whole."""
    from kvpool.net.protocol import Header

    with NodeProcess(tmp_path, dram={"capacity": "16MiB", "slab_size": "4MiB"},
                     ssd={"enabled": False}) as node:
        conn, first = connected(node.address)
        key = os.urandom(16)
        frames = [Header(Op.PUT, 901, 1, 32, CHUNK).pack() + pack_keys(NS.id, [key])
                  + payload_for(key, CHUNK).tobytes(),
                  Header(Op.PING, 902, 0, 0, 0).pack(),
                  Header(Op.GET, 903, 2, 48, 0).pack() + pack_keys(NS.id, [key, first[0]]),
                  Header(Op.EXISTS, 904, 2, 48, 0).pack() + pack_keys(NS.id, [first[1], key])]
        conn.sock.sendall(b"".join(frames))
        answers = [_read_answer(conn) for _ in frames]
        assert [h.req_id for h, _m, _p in answers] == [901, 902, 903, 904]
        assert all(h.status == 0 for h, _m, _p in answers)
        assert answers[0][0].count == 1  # stored
        got = answers[2]
        assert got[1] == b"\x01\x01" and got[2] == (payload_for(key, CHUNK).tobytes()
                                                   + payload_for(first[0], CHUNK).tobytes())
        assert answers[3][1] == b"\x01\x01"
        check_get(conn, [key, *first])  # the connection is still in step
        conn.close()
