"""Fuzz a real node with random, truncated, oversized and malformed frames (seeded, thousands
of cases): it must stay up, keep its memory bounded, and keep serving other connections."""

from __future__ import annotations

import json
import os
import random
import socket
import struct
from pathlib import Path

import numpy as np
from kvtest import byte_namespace, payload_for
from node_process import NodeProcess

from kvpool.keys import canonical_json
from kvpool.net.connection import NodeConnection
from kvpool.net.protocol import HEADER, MAGIC, PROTOCOL_VERSION, Header, Op

CASES = 5000
CHUNK = 4096
NS = byte_namespace(CHUNK, salt="fuzz")
CONTROL = byte_namespace(CHUNK, salt="control")  # never named by the fuzzer


def header(rng: random.Random, op: int, count: int, meta_len: int, payload_len: int) -> bytes:
    return Header(op, rng.getrandbits(64), count, meta_len, payload_len).pack()


def valid_frames(rng: random.Random) -> list[bytes]:
    """Well-formed requests the mutators start from."""
    keys = [rng.randbytes(16) for _ in range(rng.randint(1, 4))]
    meta = NS.id + b"".join(keys)
    ns_json = canonical_json(NS.canonical())
    payload = rng.randbytes(CHUNK * len(keys))
    return [
        header(rng, Op.PING, 0, 0, 0),
        header(rng, Op.NAMESPACE, 0, len(ns_json), 0) + ns_json,
        header(rng, Op.EXISTS_PREFIX, len(keys), len(meta), 0) + meta,
        header(rng, Op.EXISTS, len(keys), len(meta), 0) + meta,
        header(rng, Op.TOUCH, len(keys), len(meta), 0) + meta,
        header(rng, Op.GET, len(keys), len(meta), 0) + meta,
        header(rng, Op.PUT, len(keys), len(meta), len(payload)) + meta + payload,
        header(rng, Op.DELETE, len(keys), len(meta), 0) + meta,
        header(rng, Op.INVALIDATE, 0, 16, 0) + NS.id,
        header(rng, Op.STATS, 0, 0, 0),
    ]


def mutate(rng: random.Random) -> bytes:
    kind = rng.randrange(8)
    frames = valid_frames(rng)
    if kind == 0:  # noise
        return rng.randbytes(rng.randint(0, 300))
    if kind == 1:  # a valid exchange cut anywhere
        data = b"".join(rng.sample(frames, 3))
        return data[:rng.randint(0, len(data))]
    if kind == 2:  # bit flips in a valid frame
        data = bytearray(rng.choice(frames))
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return bytes(data)
    if kind == 3:  # huge or lying lengths
        return HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, rng.choice(list(Op)),
                           rng.getrandbits(64), rng.choice([0, 1, 2**16, 2**32 - 1]),
                           rng.choice([0, 15, 17, 2**20, 2**32 - 1]),
                           rng.choice([0, 1, 2**31, 2**63])) + rng.randbytes(rng.randint(0, 64))
    if kind == 4:  # unknown opcodes, response bits, statuses
        return HEADER.pack(MAGIC, PROTOCOL_VERSION, rng.randrange(256),
                           rng.choice([0, 12, 999, 0x8005, 0xFFFF]), 1, 0, 0, 0)
    if kind == 5:  # bad namespace documents
        doc = rng.choice([b"{", b"[]", b"null", json.dumps({"model": 1}).encode(),
                          canonical_json(dict(NS.canonical(), layout={"dtype": "x"})),
                          rng.randbytes(40)])
        return header(rng, Op.NAMESPACE, 0, len(doc), 0) + doc
    if kind == 6:  # PUT whose payload does not match its keys, on a declared namespace
        ns_json = canonical_json(NS.canonical())
        meta = NS.id + rng.randbytes(16)
        wrong = rng.choice([0, CHUNK - 1, CHUNK + 1, 3 * CHUNK])
        return (header(rng, Op.NAMESPACE, 0, len(ns_json), 0) + ns_json
                + header(rng, Op.PUT, 1, len(meta), wrong) + meta + rng.randbytes(min(wrong, 99)))
    # several valid frames back to back, the last one truncated
    data = b"".join(rng.choice(frames) for _ in range(4))
    return data[:-rng.randint(1, 20)]


def send_case(port: int, data: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(1 << 16):
                pass
        except OSError:
            pass  # the node closed on us (reset, not connected): allowed


def test_fuzzed_frames_never_take_the_node_down(tmp_path: Path) -> None:
    node = NodeProcess(tmp_path / "fuzz", dram={"capacity": "16MiB", "slab_size": "1MiB"},
                       ssd={"capacity": "32MiB", "segment_size": "4MiB"})
    node.start()
    try:
        control = NodeConnection(node.address)
        keys = [os.urandom(16) for _ in range(4)]
        assert control.put(CONTROL, keys, [payload_for(k, CHUNK) for k in keys]) == 4
        rng = random.Random(20261130)
        for _ in range(200):  # warm up allocator pools before measuring memory
            send_case(node.port, mutate(rng))
        rss_before = node.rss_bytes()
        for i in range(CASES):
            send_case(node.port, mutate(rng))
            if i % 250 == 0:
                control.ping()
        assert node.alive()
        outs = [np.zeros(CHUNK, np.uint8) for _ in keys]
        assert control.get_into(CONTROL, keys, outs) == [True] * 4
        for key, out in zip(keys, outs, strict=True):
            assert np.array_equal(out, payload_for(key, CHUNK))
        growth = node.rss_bytes() - rss_before
        assert growth < 48 << 20, f"node RSS grew by {growth >> 20} MiB under fuzzing"
        stats = control.stats()["server"]
        assert stats["protocol_errors"] > 100
        control.close()
    finally:
        node.stop()


def test_a_stalled_half_frame_is_closed_after_the_idle_timeout(tmp_path: Path) -> None:
    node = NodeProcess(tmp_path / "idle", server={"idle_timeout_s": 0.5})
    node.start()
    try:
        with socket.create_connection(("127.0.0.1", node.port), timeout=10) as sock:
            sock.sendall(struct.pack("<4sB", MAGIC, PROTOCOL_VERSION))  # 5 of 32 bytes
            assert sock.recv(10) == b""  # closed by the node, not by us
        NodeConnection(node.address).ping()
    finally:
        node.stop()
