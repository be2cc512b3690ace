"""Frames on the host pool's Unix socket: a struct header, JSON metadata, a binary tail.

A frame is ``<II`` (metadata length, tail length), the metadata (a UTF-8 JSON object: the
op and its small arguments, or an answer), then the tail: 16-byte keys back to back, or a
payload on the rare byte fallbacks. JSON and raw bytes only: nothing read from a peer is
ever unpickled. The attach answer carries the arena's file descriptor (SCM_RIGHTS).

Failure contract: ``recv_frame`` raises ``WireError`` for a malformed or oversized frame and
``ConnectionError`` when the peer is gone (EOF mid-frame included); a socket timeout is
``TimeoutError``. Both ends treat either as the end of the connection.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.keys import KEY_BYTES

HEADER = struct.Struct("<II")
#: Metadata is small (op names, ints, offsets): this bounds what a peer can make us parse.
MAX_META_BYTES = 8 << 20

#: Ops (request ``op`` field). Answers carry ``ok`` (True, or False with ``error``).
HELLO = "hello"
NAMESPACE = "ns"
LOOKUP = "lookup"
CONTAINS = "contains"
PIN = "pin"            # "batch": one pin id for all its chunks (a get: unpinned together)
UNPIN = "unpin"        # no answer: sent ahead of the next request
RESERVE = "reserve"
COMMIT = "commit"
RETAIN = "retain"
RELEASE = "release"
ABORT = "abort"        # no answer
PUT = "put"            # payload in the tail: a reservation that got no arena slot
GET = "get"            # answer payload in the tail: chunks no DRAM slot could take
DELETE = "delete"
INVALIDATE = "invalidate"
TOUCH = "touch"
FLUSH = "flush"
STATS = "stats"
NO_ANSWER = frozenset({UNPIN, ABORT})


class WireError(ConnectionError):
    """A frame that breaks the format or the limits: the connection is closed."""


#: What a frame's tail may be.
Bytes = bytes | bytearray | memoryview


def pack_keys(keys: Sequence[bytes]) -> bytes:
    return b"".join(keys)


def unpack_keys(tail: Bytes, count: int) -> list[bytes]:
    """``count`` 16-byte keys from ``tail``; WireError if its length disagrees."""
    if count < 0 or len(tail) != count * KEY_BYTES:
        raise WireError(f"{len(tail)} key bytes for {count} keys")
    raw = bytes(tail)
    return [raw[i:i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]


def encode(meta: dict[str, Any], tail: Bytes = b"") -> tuple[bytes, Bytes]:
    """(header + metadata, tail)."""
    body = json.dumps(meta, separators=(",", ":"), default=str).encode()
    return HEADER.pack(len(body), len(tail)) + body, tail


def send_frame(sock: socket.socket, meta: dict[str, Any], tail: Bytes = b"",
               fds: Sequence[int] = ()) -> None:
    head, tail = encode(meta, tail)
    if fds:
        socket.send_fds(sock, [head + bytes(tail)], list(fds))
    elif len(tail) < 65536:
        sock.sendall(head + bytes(tail))
    else:  # a payload (the byte fallbacks): not copied into one buffer first
        sock.sendall(head)
        sock.sendall(tail)


def send_frames(sock: socket.socket, frames: Sequence[tuple[dict[str, Any], Bytes]]) -> None:
    """Several frames back to back; one write when they are small (the host pool reads
    them in one wake-up)."""
    encoded = [encode(meta, tail) for meta, tail in frames]
    if sum(len(h) + len(t) for h, t in encoded) < 65536:
        sock.sendall(b"".join(h + bytes(t) for h, t in encoded))
        return
    for head, tail in encoded:
        sock.sendall(head)
        if len(tail):
            sock.sendall(tail)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise ConnectionError("peer closed the connection")
        got += r
    return buf


#: A frame larger than this (metadata + tail) is "large": ``recv_frame``'s ``admit`` is asked
#: for its bytes and its body must arrive within ``body_timeout_s``.
LARGE_FRAME = 64 << 10


def recv_frame(sock: socket.socket, max_tail: int, want_fds: int = 0,
               admit: Callable[[int], None] | None = None,
               body_timeout_s: float | None = None
               ) -> tuple[dict[str, Any], bytearray, list[int]]:
    """One frame: (metadata, tail, file descriptors received with it). For a large frame
    (over ``LARGE_FRAME``), ``admit(size)`` is called before its body is read (it raises,
    e.g. WireError, to refuse it; the caller gives the bytes back once it is done with the
    frame) and, with ``body_timeout_s``, a body that does not arrive in time is TimeoutError."""
    fds: list[int] = []
    if want_fds:
        head, fds, _, _ = socket.recv_fds(sock, HEADER.size, want_fds)
        if not head:
            raise ConnectionError("peer closed the connection")
        head = bytes(head) + bytes(_recv_exact(sock, HEADER.size - len(head))) \
            if len(head) < HEADER.size else bytes(head)
    else:
        head = bytes(_recv_exact(sock, HEADER.size))
    meta_len, tail_len = HEADER.unpack(head)
    if meta_len > MAX_META_BYTES or tail_len > max_tail:
        raise WireError(f"frame of {meta_len} + {tail_len} bytes exceeds the limits "
                        f"({MAX_META_BYTES} + {max_tail})")
    large = meta_len + tail_len > LARGE_FRAME
    if large and admit is not None:
        admit(meta_len + tail_len)
    if large and body_timeout_s is not None:
        idle = sock.gettimeout()
        sock.settimeout(body_timeout_s)
        try:
            body = _recv_exact(sock, meta_len)
            tail = _recv_exact(sock, tail_len) if tail_len else bytearray()
        finally:
            sock.settimeout(idle)
    else:
        body = _recv_exact(sock, meta_len)
        tail = _recv_exact(sock, tail_len) if tail_len else bytearray()
    try:
        meta = json.loads(body)
    except ValueError as exc:
        raise WireError(f"metadata is not JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise WireError("metadata is not an object")
    return meta, tail, fds
