"""The client's receive of a GET answer larger than its inbox (header, flags and the start of
the payload in one scatter receive, part of it straight into the first key's buffer; the rest
into the hits' buffers) against a scripted peer on a real socket: hits land in their own
buffers whatever the flags and however the answer is sliced, and an answer that is short,
truncated, oversized or malformed raises (the connection is then dropped; through a
ClusterClient it is a miss), never reports a hit with wrong bytes."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import numpy as np
import pytest
from kvtest import byte_namespace
from node_process import NodeProcess
from tests_support import Script, ScriptedPeer

from kvpool.config import ClusterConfig
from kvpool.net.client import ClusterClient
from kvpool.net.connection import INBOX_BYTES, SPECULATE_BYTES, NodeConnection
from kvpool.net.protocol import (
    HEADER_BYTES,
    RESPONSE_BIT,
    Header,
    ProtocolError,
    RemoteError,
    Status,
)

CHUNK = 256 << 10  # one chunk's answer is larger than the client's inbox
NS = byte_namespace(CHUNK, salt="get-answer")
assert HEADER_BYTES + 1 + CHUNK > INBOX_BYTES and CHUNK > SPECULATE_BYTES


def chunk(n: int) -> bytes:
    return bytes([n]) * (CHUNK // 2) + bytes([n + 100]) * (CHUNK // 2)


@pytest.fixture
def peer() -> Iterator[ScriptedPeer]:
    p = ScriptedPeer(NS.id)
    yield p
    p.close()


def frame(req: Header, flags: bytes, payload: bytes, status: Status = Status.OK,
          req_id: int | None = None, count: int | None = None) -> bytes:
    head = Header(req.op | RESPONSE_BIT, req.req_id if req_id is None else req_id,
                  flags.count(1) if count is None else count, len(flags), len(payload), status)
    return head.pack() + flags + payload


def outs(n: int) -> list[np.ndarray]:
    return [np.zeros(CHUNK, np.uint8) for _ in range(n)]


def keys(n: int) -> list[bytes]:
    return [bytes([i + 1]) * 16 for i in range(n)]


@pytest.mark.parametrize("flags", [b"\x01", b"\x01\x01\x01", b"\x00\x01\x01", b"\x00\x00\x01",
                                   b"\x01\x00\x01", b"\x00\x00\x00"])
@pytest.mark.parametrize("sliced", ["whole", "header in pieces", "at the inbox's edge",
                                    "byte by byte head"])
def test_hits_land_in_their_own_buffers(peer: ScriptedPeer, flags: bytes, sliced: str) -> None:
    """Every flag pattern (a first key that missed makes the first hit's bytes land in a
    missed key's buffer first), however the answer arrives."""
    hits = [i for i, f in enumerate(flags) if f]
    data = [chunk(i + 1) for i in range(len(flags))]

    def script(req: Header) -> list[bytes]:
        whole = frame(req, flags, b"".join(data[i] for i in hits))
        cut = {"whole": [], "header in pieces": [5, HEADER_BYTES + 1],
               "at the inbox's edge": [HEADER_BYTES + len(flags) + SPECULATE_BYTES,
                                       HEADER_BYTES + len(flags) + SPECULATE_BYTES + 7],
               "byte by byte head": list(range(1, HEADER_BYTES + len(flags) + 3))}[sliced]
        bounds = [0, *(c for c in cut if c < len(whole)), len(whole)]
        return [whole[a:b] for a, b in itertools.pairwise(bounds)]

    peer.scripts += [script, script]
    conn = NodeConnection(peer.address, request_timeout=5.0)
    bufs = outs(len(flags))
    for _ in range(2):  # the connection stays in step for the next answer
        assert conn.get_into(NS, keys(len(flags)), bufs) == [f == 1 for f in flags]
        for i in hits:
            assert bufs[i].tobytes() == data[i]
    conn.close()


def bad_answers() -> dict[str, Script]:
    one = chunk(7)
    return {
        "truncated payload, then closed": lambda req: [frame(req, b"\x01", one)[:CHUNK // 2],
                                                       b""],
        "truncated header, then closed": lambda req: [frame(req, b"\x01", one)[:20], b""],
        "flags lie (two chunks for one hit)": lambda req: [frame(req, b"\x01", one + one)],
        "flags lie (a hit without its chunk)": lambda req: [frame(req, b"\x01", b"")],
        "flags not 0/1": lambda req: [frame(req, b"\x02", one, count=1)],
        "more flags than keys": lambda req: [frame(req, b"\x01\x00", one)],
        "bytes after the answer": lambda req: [frame(req, b"\x00", b"") + b"x" * 100],
        "wrong id": lambda req: [frame(req, b"\x01", one, req_id=req.req_id + 1)],
        "bad magic": lambda req: [b"XXXX" + frame(req, b"\x01", one)[4:]],
        "error with a payload": lambda req: [frame(req, b"", one, Status.BUSY)],
        "error message past the inbox": lambda req: [
            frame(req, b"m" * (INBOX_BYTES + 10), b"", Status.BUSY)],
        "error": lambda req: [frame(req, b"busy", b"", Status.BUSY)],
    }


BAD = bad_answers()


@pytest.mark.parametrize("answer", list(BAD))
def test_a_bad_answer_raises_and_is_a_miss_for_the_cluster_client(peer: ScriptedPeer,
                                                                  answer: str) -> None:
    """Closed connection, oversized, lying or malformed: NodeConnection raises (RemoteError
    only for a well-formed error answer); the ClusterClient reports a miss."""
    peer.scripts.append(BAD[answer])
    conn = NodeConnection(peer.address, request_timeout=5.0)
    expected: type[Exception] = RemoteError if answer == "error" else \
        ConnectionError if "closed" in answer else ProtocolError
    with pytest.raises(expected):
        conn.get_into(NS, keys(1), outs(1))
    conn.close()

    peer.scripts.append(BAD[answer])
    client = ClusterClient(ClusterConfig(nodes=[peer.address], request_timeout_s=5.0))
    try:
        assert client.get_many_into(NS, keys(1), outs(1)) == [False]
        assert client.stats()["get_misses"] == 1
    finally:
        client.close()


def test_a_short_answer_then_silence_times_out(peer: ScriptedPeer) -> None:
    """Part of the payload, then nothing: TimeoutError after request_timeout, no hit."""
    peer.scripts.append(lambda req: [frame(req, b"\x01", chunk(3))[:CHUNK // 3]])
    conn = NodeConnection(peer.address, request_timeout=0.5)
    with pytest.raises(TimeoutError):
        conn.get_into(NS, keys(1), outs(1))
    conn.close()


def test_random_cuts_and_flips_never_report_a_wrong_hit(peer: ScriptedPeer) -> None:
    """Seeded: valid answers of 1-3 keys cut short (then closed), with a bit of the header
    or the flags flipped, or with bytes appended; each either raises or returns flags whose
    hits hold exactly their chunks."""
    rng = random.Random(24)
    for _ in range(60):
        n = rng.randint(1, 3)
        flags = bytes(rng.randint(0, 1) for _ in range(n))
        data = [chunk(10 + i) for i in range(n)]
        kind, at, bit = rng.randrange(3), rng.randrange(HEADER_BYTES + n), rng.randrange(8)
        cut, extra = rng.random(), rng.randbytes(rng.randint(1, 64))

        def script(req: Header, flags: bytes = flags, data: list[bytes] = data, kind: int = kind,
                   at: int = at, bit: int = bit, cut: float = cut,
                   extra: bytes = extra) -> list[bytes]:
            whole = bytearray(frame(req, flags, b"".join(
                d for d, f in zip(data, flags, strict=True) if f)))
            if kind == 0:
                whole = whole[:int(cut * len(whole))]
            elif kind == 1:
                whole[at] ^= 1 << bit
            else:
                whole += extra
            return [bytes(whole), b""]

        peer.scripts.append(script)
        conn = NodeConnection(peer.address, request_timeout=2.0)
        bufs = outs(n)
        try:
            got = conn.get_into(NS, keys(n), bufs)
        except (OSError, ProtocolError, RemoteError):
            pass
        else:
            for i, hit in enumerate(got):
                if hit:
                    assert bufs[i].tobytes() == data[i]
        finally:
            conn.close()
        peer.scripts.clear()


def test_a_real_node_answers_mixed_hits_of_large_chunks_into_the_right_buffers(
        node: NodeProcess) -> None:
    """Against ``kvpool serve``: a GET of 256 KiB chunks whose first key (and another) the
    node lacks lands each hit in its own buffer (the first hit's bytes come in through the
    first key's buffer), then an all-hit GET and an all-miss GET on the same connection."""
    client = ClusterClient(ClusterConfig(nodes=[node.address], request_timeout_s=10.0))
    try:
        client.register_namespace(NS)
        held = keys(5)[1::2]  # keys 1 and 3 of 0..4
        data = {k: chunk(20 + i) for i, k in enumerate(held)}
        assert client.put_many([(k, NS, np.frombuffer(data[k], np.uint8)) for k in held]) == 2
        asked = keys(5)[:4]
        bufs = outs(4)
        assert client.get_many_into(NS, asked, bufs) == [False, True, False, True]
        assert bufs[1].tobytes() == data[asked[1]] and bufs[3].tobytes() == data[asked[3]]
        bufs = outs(2)
        assert client.get_many_into(NS, held, bufs) == [True, True]
        assert [b.tobytes() for b in bufs] == [data[k] for k in held]
        assert client.get_many_into(NS, [bytes(16)], outs(1)) == [False]
        stats = client.stats()
        assert stats.get("node_failures", 0) == 0 and stats["down_nodes"] == []
    finally:
        client.close()
