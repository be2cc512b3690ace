"""Frames on the host pool's Unix socket: a struct header, JSON metadata, a binary tail.

A frame is ``<II`` (metadata length, tail length), the metadata (a UTF-8 JSON object: the
op and its small arguments, or an answer), then the tail: 16-byte keys back to back, a pin
answer's (pin id, arena offset) pairs as native int64 (``pack_pins``: per-key data stays
out of JSON, which cost more than the pins themselves on a 64-key read), or a payload on
the rare byte fallbacks. JSON and raw bytes only: nothing read from a peer is ever
unpickled. The attach answer carries the arena's file descriptor and, where the host pool
keeps one, its read directory's (tiers/directory.py), by SCM_RIGHTS. Both ends
speak ``VERSION``: a HELLO of another version is refused with a message saying so (the
engine and its host pool run one kvpool release).

Failure contract: ``recv_frame`` and ``FrameReader.read`` raise ``WireError`` for a malformed
or oversized frame and ``ConnectionError`` when the peer is gone (EOF mid-frame included); a
socket timeout is ``TimeoutError`` (Python's) or ``BlockingIOError`` (the kernel's,
``set_kernel_timeouts``). Both ends treat any of them as the end of the connection.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import socket
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvpool.keys import KEY_BYTES, split_key_bytes

HEADER = struct.Struct("<II")
#: The frame layout's version, sent in HELLO; the host pool refuses any other.
VERSION = 3
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
READS = "reads"        # no answer: keys an engine read through the directory, to count
NO_ANSWER = frozenset({UNPIN, ABORT, READS})
#: Keys one READS frame may carry (an engine sends at most this many per namespace at once):
#: a longer list would hold the host pool's interpreter while it is split and counted.
MAX_READS_KEYS = 1 << 16
#: A request may carry ``"unpin": [ids]``: pins released before it is served (the engine's
#: pending unpins ride on its next request instead of a frame of their own).
UNPIN_FIELD = "unpin"

#: A pin answer's offset for a chunk that is not pinned: a miss, or (``IN_TAIL``) a chunk
#: whose bytes follow the pairs in the answer's tail (a ``read`` fallback).
MISS = -1
IN_TAIL = -2
#: Bytes of one (pin id, offset) pair: a pin answer's tail holds ``n`` of them, then the
#: carried chunks' bytes.
PAIR_BYTES = 16


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
    return split_key_bytes(bytes(tail))


def pack_pins(pairs: Sequence[tuple[int, int]]) -> bytes:
    """A pin answer's per-key (pin id, arena offset or MISS / IN_TAIL), as native int64s."""
    return struct.pack(f"{2 * len(pairs)}q", *itertools.chain.from_iterable(pairs))


def unpack_pins(tail: Bytes, count: int) -> list[int]:
    """The flat [pin, offset, pin, offset, ...] of a pin answer for ``count`` keys (the
    tail's first ``16 * count`` bytes); WireError when the tail is shorter."""
    if count < 0 or len(tail) < count * PAIR_BYTES:
        raise WireError(f"{len(tail)} answer bytes for {count} pins")
    return memoryview(tail)[:count * PAIR_BYTES].cast("q").tolist()


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
    _recv_into(sock, memoryview(buf))
    return buf


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ConnectionError at EOF."""
    got, n = 0, len(view)
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise ConnectionError("peer closed the connection")
        got += r


#: A frame larger than this (metadata + tail) is "large": ``recv_frame``'s ``admit`` is asked
#: for its bytes and its body must arrive within ``body_timeout_s``.
LARGE_FRAME = 64 << 10


def recv_frame(sock: socket.socket, max_tail: int, want_fds: int = 0,
               admit: Callable[[int], None] | None = None,
               body_timeout_s: float | None = None
               ) -> tuple[dict[str, Any], bytearray, list[int]]:
    """One frame, read exactly (nothing past it is consumed: the attach exchange, whose
    answer brings the arena's descriptor): (metadata, tail, file descriptors received with
    it). ``admit`` and ``body_timeout_s`` as in ``FrameReader.read``."""
    fds: list[int] = []
    if want_fds:
        head, fds, _, _ = socket.recv_fds(sock, HEADER.size, want_fds)
        if not head:
            raise ConnectionError("peer closed the connection")
        head = bytes(head) + bytes(_recv_exact(sock, HEADER.size - len(head))) \
            if len(head) < HEADER.size else bytes(head)
    else:
        head = bytes(_recv_exact(sock, HEADER.size))
    meta_len, tail_len = _sizes(head, max_tail)
    large = meta_len + tail_len > LARGE_FRAME
    if large and admit is not None:
        admit(meta_len + tail_len)
    with _body_deadline(sock, body_timeout_s if large else None):
        body = _recv_exact(sock, meta_len)
        tail = _recv_exact(sock, tail_len) if tail_len else bytearray()
    return _meta(body), tail, fds


def _sizes(head: Bytes, max_tail: int) -> tuple[int, int]:
    meta_len, tail_len = HEADER.unpack(head)
    if meta_len > MAX_META_BYTES or tail_len > max_tail:
        raise WireError(f"frame of {meta_len} + {tail_len} bytes exceeds the limits "
                        f"({MAX_META_BYTES} + {max_tail})")
    return meta_len, tail_len


def _meta(body: bytes | bytearray) -> dict[str, Any]:
    try:
        meta = json.loads(body)
    except ValueError as exc:
        raise WireError(f"metadata is not JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise WireError("metadata is not an object")
    return meta


@contextlib.contextmanager
def _body_deadline(sock: socket.socket, seconds: float | None) -> Iterator[None]:
    """The socket's timeout is ``seconds`` inside (unchanged when None)."""
    if seconds is None:
        yield
        return
    idle = sock.gettimeout()
    sock.settimeout(seconds)
    try:
        yield
    finally:
        sock.settimeout(idle)


def set_kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """Bound every blocking send and receive on ``sock`` by ``seconds`` in the kernel
    (SO_SNDTIMEO / SO_RCVTIMEO), with Python's own timeout off: one syscall per send or
    receive instead of a poll before each (a timeout past it raises BlockingIOError, an
    OSError)."""
    sock.settimeout(None)
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


class FrameReader:
    """The frames arriving on one socket, read through a buffer of its own: a small frame
    (header, metadata and tail) costs one ``recv``, not three, and frames sent back to back
    are parsed from the same read. One reader per socket, used by one thread at a time.

    Failure contract as ``recv_frame``: WireError (the format or a limit broken),
    ConnectionError (the peer gone, EOF mid-frame included), OSError from the socket."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        # A small frame must fit whole (64 KiB and its header: an attached connection's cost)
        self._buf = bytearray(HEADER.size + LARGE_FRAME)
        self._view = memoryview(self._buf)
        self._start = 0  # the unparsed bytes are _buf[_start:_end]
        self._end = 0

    def _fill(self, need: int) -> None:
        """At least ``need`` (<= the buffer's size) unparsed bytes in the buffer."""
        if self._start + need > len(self._buf):  # move the unparsed bytes to the front
            kept = self._end - self._start
            self._buf[:kept] = self._buf[self._start:self._end]
            self._start, self._end = 0, kept
        while self._end - self._start < need:
            got = self._sock.recv_into(self._view[self._end:])
            if got == 0:
                raise ConnectionError("peer closed the connection")
            self._end += got

    def _take(self, n: int) -> bytearray:
        """Up to ``n`` unparsed bytes already in the buffer (a copy), consumed."""
        n = min(n, self._end - self._start)
        out = self._buf[self._start:self._start + n]
        self._start += n
        if self._start == self._end:
            self._start = self._end = 0
        return out

    def read(self, max_tail: int, admit: Callable[[int], None] | None = None,
             body_timeout_s: float | None = None) -> tuple[dict[str, Any], bytearray]:
        """The next frame: (metadata, tail). A large frame (over ``LARGE_FRAME``) calls
        ``admit(size)`` before its body is read (it raises, e.g. WireError, to refuse it;
        the caller gives the bytes back once done with the frame) and, with
        ``body_timeout_s``, a body that does not arrive in time is TimeoutError."""
        self._fill(HEADER.size)
        meta_len, tail_len = _sizes(self._view[self._start:self._start + HEADER.size],
                                    max_tail)
        self._start += HEADER.size
        size = meta_len + tail_len
        if size <= LARGE_FRAME:
            self._fill(size)
            meta = _meta(self._take(meta_len))
            return meta, self._take(tail_len)
        if admit is not None:
            admit(size)
        with _body_deadline(self._sock, body_timeout_s):
            body = self._take_exact(meta_len)
            tail = self._take_exact(tail_len)
        return _meta(body), tail

    def _take_exact(self, n: int) -> bytearray:
        """``n`` bytes: those in the buffer, the rest received straight into the result."""
        have = self._end - self._start
        if have >= n:
            return self._take(n)
        out = bytearray(n)
        out[:have] = self._view[self._start:self._end]
        self._start = self._end = 0
        _recv_into(self._sock, memoryview(out)[have:])
        return out
