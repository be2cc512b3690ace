"""The client's one-receive GET (an answer that fits the connection's inbox is received whole,
then copied out) against a scripted peer: hits and misses land in the right buffers, an answer
arriving in pieces is put together, and an answer that is not what was asked raises
ProtocolError or the node's error, never writes into the caller's buffers."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
from kvtest import byte_namespace
from tests_support import ScriptedPeer

from kvpool.net.connection import INBOX_BYTES, NodeConnection
from kvpool.net.protocol import (
    HEADER_BYTES,
    RESPONSE_BIT,
    Header,
    ProtocolError,
    RemoteError,
    Status,
)

CHUNK = 4096
NS = byte_namespace(CHUNK, salt="small-get")
Answer = Callable[[Header], list[bytes]]  # the request's header -> the pieces to send


@pytest.fixture
def peer() -> Iterator[tuple[str, list[Answer]]]:
    """A scripted peer (tests_support.ScriptedPeer) answering GETs with the queued scripts."""
    p = ScriptedPeer(NS.id)
    yield p.address, p.scripts
    p.close()


def frame(req: Header, flags: bytes, payload: bytes, status: Status = Status.OK,
          req_id: int | None = None) -> bytes:
    head = Header(req.op | RESPONSE_BIT, req.req_id if req_id is None else req_id,
                  flags.count(1), len(flags), len(payload), status)
    return head.pack() + flags + payload


def connect(address: str) -> NodeConnection:
    conn = NodeConnection(address, request_timeout=5.0)
    conn.declared.add(NS.id)  # the scripted peer knows no NAMESPACE
    return conn


def test_hits_and_misses_land_in_their_buffers_also_when_the_answer_comes_in_pieces(
        peer: tuple[str, list[Answer]]) -> None:
    address, scripts = peer
    a, b = bytes([7]) * CHUNK, bytes([9]) * CHUNK
    scripts.append(lambda req: [frame(req, b"\x01\x00\x01", a + b)])
    scripts.append(lambda req: [(f := frame(req, b"\x01", b))[:HEADER_BYTES - 5],
                                f[HEADER_BYTES - 5:HEADER_BYTES + 100], f[HEADER_BYTES + 100:]])
    conn = connect(address)
    outs = [np.zeros(CHUNK, np.uint8) for _ in range(3)]
    assert conn.get_into(NS, [bytes(16)] * 3, outs) == [True, False, True]
    assert outs[0].tobytes() == a and not outs[1].any() and outs[2].tobytes() == b
    one = [np.zeros(CHUNK, np.uint8)]
    assert conn.get_into(NS, [bytes(16)], one) == [True]
    assert one[0].tobytes() == b
    conn.close()


@pytest.mark.parametrize("answer", ["wrong id", "too large", "flags lie", "error"])
def test_an_answer_that_is_not_what_was_asked_raises(peer: tuple[str, list[Answer]],
                                                     answer: str) -> None:
    address, scripts = peer
    data = bytes([5]) * CHUNK
    scripts.append({
        "wrong id": lambda req: [frame(req, b"\x01", data, req_id=req.req_id + 1)],
        "too large": lambda req: [frame(req, b"\x01", bytes(INBOX_BYTES))],
        "flags lie": lambda req: [frame(req, b"\x01", data + data)],
        "error": lambda req: [Header(req.op | RESPONSE_BIT, req.req_id, 0, 4, 0,
                                     Status.BUSY).pack() + b"busy"],
    }[answer])
    conn = connect(address)
    out = np.zeros(CHUNK, np.uint8)
    with pytest.raises(RemoteError if answer == "error" else ProtocolError):
        conn.get_into(NS, [bytes(16)], [out])
    assert not out.any()
    conn.close()
