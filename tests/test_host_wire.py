"""The host socket's frame reader on real socket pairs: frames arriving together, byte by
byte, large past its buffer, broken, or cut off, and the kernel's request timeout."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from kvpool.host import wire


@pytest.fixture()
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


def frame(meta: dict[str, object], tail: bytes = b"") -> bytes:
    head, body = wire.encode(meta, tail)
    return head + bytes(body)


def test_frames_sent_together_are_read_one_by_one(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(frame({"op": "unpin", "ids": [1, 2]}) + frame({"op": "pin", "n": 1}, b"k" * 16)
              + frame({"op": "stats"}))
    reader = wire.FrameReader(b)
    assert reader.read(1 << 20) == ({"op": "unpin", "ids": [1, 2]}, bytearray())
    assert reader.read(1 << 20) == ({"op": "pin", "n": 1}, bytearray(b"k" * 16))
    assert reader.read(1 << 20) == ({"op": "stats"}, bytearray())


def test_a_frame_arriving_byte_by_byte_is_read_whole(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    data = frame({"op": "pin", "n": 2}, bytes(range(32)))

    def trickle() -> None:
        for i in range(len(data)):
            a.send(data[i:i + 1])
            time.sleep(0.001)

    sender = threading.Thread(target=trickle)
    sender.start()
    try:
        assert wire.FrameReader(b).read(1 << 20) == ({"op": "pin", "n": 2},
                                                     bytearray(range(32)))
    finally:
        sender.join()


def test_large_frames_between_small_ones_are_admitted_and_read_exactly(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    big = bytes(range(256)) * (3 * wire.LARGE_FRAME // 256)  # past the reader's buffer
    admitted: list[int] = []
    data = frame({"op": "a"}) + frame({"op": "put", "n": 1}, big) + frame({"op": "b"}, b"x")
    sender = threading.Thread(target=a.sendall, args=(data,))
    sender.start()
    reader = wire.FrameReader(b)
    try:
        assert reader.read(1 << 30, admit=admitted.append)[0] == {"op": "a"}
        meta, tail = reader.read(1 << 30, admit=admitted.append, body_timeout_s=5)
        assert meta == {"op": "put", "n": 1} and tail == big
        head, _ = wire.encode({"op": "put", "n": 1}, big)
        assert admitted == [len(head) - wire.HEADER.size + len(big)]  # metadata and tail
        assert reader.read(1 << 30) == ({"op": "b"}, bytearray(b"x"))
    finally:
        sender.join()


def test_broken_frames_and_a_peer_gone_mid_frame_are_errors(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    reader = wire.FrameReader(b)
    a.sendall(wire.HEADER.pack(3, 0) + b"[1]")
    with pytest.raises(wire.WireError, match="not an object"):
        reader.read(1 << 20)
    a.sendall(wire.HEADER.pack(2, 1 << 20))
    with pytest.raises(wire.WireError, match="exceeds the limits"):
        reader.read(1024)
    c, d = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    c.sendall(frame({"op": "x"}, b"0123456789")[:-4])
    c.close()
    with pytest.raises(ConnectionError):
        wire.FrameReader(d).read(1 << 20)
    d.close()


def test_the_kernel_timeout_ends_a_wait_for_a_silent_peer(
        pair: tuple[socket.socket, socket.socket]) -> None:
    _, b = pair
    wire.set_kernel_timeouts(b, 0.2)
    assert b.gettimeout() is None  # no poll before each call: the kernel keeps the time
    assert struct.unpack("ll", b.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16)) \
        == (0, 200000)
    started = time.monotonic()
    with pytest.raises(OSError):
        wire.FrameReader(b).read(1 << 20)
    assert 0.15 < time.monotonic() - started < 5
