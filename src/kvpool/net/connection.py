"""A blocking connection to one storage node, and a small pool of them per node.

GET answers are received straight into the caller's buffers (a small one whole into the
connection's inbox, then copied out); PUT payloads are sent from the caller's buffers with
scatter-gather ``sendmsg``: no staging copies.

The socket is blocking, its timeouts the kernel's (SO_RCVTIMEO / SO_SNDTIMEO, set to
``request_timeout``), not Python's: a Python socket timeout polls before every ``recv``, and
under several client threads each extra syscall is one more release and re-acquisition of the
GIL. A GET answer's first receive is one scatter ``recvmsg_into`` of what has arrived (header,
flags, the start of the payload, on into the first key's buffer); the rest is asked for at
once (MSG_WAITALL) in one scatter receive into the hits' buffers, so a 2 MiB chunk is at most
two syscalls however the kernel slices it (``_get_answer``).

Failure contract: socket errors, timeouts and bytes that are not a valid answer raise
(OSError / TimeoutError / ProtocolError) and leave the connection unusable — the pool closes
it. A node that stops answering (hung, SIGSTOPped) raises TimeoutError after at most
``request_timeout`` of silence on one send or receive. An error answer from the node raises
RemoteError (AuthError for auth and tenant refusals); the connection stays usable unless the
node closes it.

With ``cluster.tls`` a TlsNodeConnection (``open_connection(..., tls=...)``, NodePool) speaks
TLS only: a node whose certificate does not verify raises TlsHandshakeError (an OSError) when
connecting, before any request is sent.
"""

from __future__ import annotations

import json
import math
import socket
import struct
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from kvpool.buffers import advance, byte_view
from kvpool.cluster.membership import parse_address
from kvpool.config import ClusterConfig
from kvpool.errors import ChunkSizeError
from kvpool.keys import Namespace, canonical_json
from kvpool.net.protocol import (
    FEATURES,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    PROTOCOL_VERSION,
    RESPONSE_BIT,
    Feature,
    Header,
    Op,
    ProtocolError,
    Status,
    error_for,
    pack_keys,
    pack_retain,
    parse_flags,
    unpack_header,
)
from kvpool.net.tls import ClientTls

IOV_MAX = 512  # iovecs per sendmsg: under the kernel's limit (UIO_MAXIOV, 1024)
#: A GET whose whole answer can be at most this large is received in one receive into the
#: connection's inbox (header, flags and payload), then copied out: one syscall, not two.
INBOX_BYTES = 64 << 10
#: A larger answer's first receive takes this much of the payload into the inbox (copied
#: out after), the rest of the first chunk straight into its buffer.
SPECULATE_BYTES = 4 << 10
#: The inbox room a GET's first receive leaves at least for an error answer's message.
ERROR_ROOM = 4 << 10
_GET_ANSWER = Op.GET | RESPONSE_BIT
_DEFAULTS = ClusterConfig()


def tune_socket(sock: socket.socket,
                buffer_bytes: int = _DEFAULTS.socket_buffer_bytes) -> None:
    """No Nagle delay; send and receive buffers of ``buffer_bytes`` (cluster.socket_buffer_bytes)
    so a multi-MiB chunk goes out in one sendmsg and neither side wakes up every few hundred
    KiB. Raises OSError if the socket refuses an option."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


def set_kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """Make ``sock`` blocking with kernel timeouts of ``seconds`` on each send and receive
    (at least 1 µs: a zero timeval would mean none). A call that times out with nothing moved
    raises BlockingIOError; one that moved some bytes returns the short count. Raises OSError
    if the socket refuses the options."""
    usec = max(1, math.ceil(seconds * 1e6))
    timeval = struct.pack("@ll", usec // 1_000_000, usec % 1_000_000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    sock.settimeout(None)


class NodeConnection:
    """One TCP connection. Not thread-safe: use one per thread (NodePool does)."""

    #: What a receive raises when the node sent nothing for ``request_timeout`` (the
    #: kernel's timeout: BlockingIOError; Python's, on a TLS socket: TimeoutError).
    SILENT: tuple[type[OSError], ...] = (BlockingIOError,)

    def __init__(self, address: str, token: str | None = None, connect_timeout: float = 0.5,
                 request_timeout: float = 5.0,
                 socket_buffer_bytes: int = _DEFAULTS.socket_buffer_bytes) -> None:
        self.address = address
        self.sock = self._dial(connect_timeout, socket_buffer_bytes)
        try:
            self._set_timeouts(request_timeout)
            self._timeout = request_timeout
            self._req_id = 0
            self._header = memoryview(bytearray(HEADER_BYTES))
            self._inbox = memoryview(bytearray(INBOX_BYTES))
            self.declared: set[bytes] = set()
            #: What the node advertised in its first NAMESPACE answer (None before that).
            self.features: Feature | None = None
            self._get_touch = False  # Feature.GET_TOUCH, as a plain bool for the GET path
            if token is not None:
                self.call(Op.AUTH, meta=token.encode())
        except BaseException:
            self.sock.close()
            raise

    def _dial(self, connect_timeout: float, socket_buffer_bytes: int) -> socket.socket:
        """The connected, tuned socket. Raises OSError."""
        sock = socket.create_connection(parse_address(self.address), timeout=connect_timeout)
        try:
            tune_socket(sock, socket_buffer_bytes)
        except BaseException:
            sock.close()
            raise
        return sock

    def _set_timeouts(self, request_timeout: float) -> None:
        set_kernel_timeouts(self.sock, request_timeout)

    def close(self) -> None:
        self.sock.close()

    # ------------------------------------------------------------------ framing
    def _timed_out(self) -> TimeoutError:
        return TimeoutError(f"node {self.address} moved nothing for {self._timeout} s")

    def _send(self, buffers: list[memoryview]) -> None:
        if len(buffers) == 1:  # a request without payload: usually one send
            try:
                sent = self.sock.send(buffers[0])
            except BlockingIOError:
                raise self._timed_out() from None
            if sent == buffers[0].nbytes:
                return
            buffers = [buffers[0][sent:]]
        bufs = [b for b in buffers if b.nbytes]
        while bufs:
            try:
                sent = self.sock.sendmsg(bufs[:IOV_MAX])
            except BlockingIOError:
                raise self._timed_out() from None
            advance(bufs, sent)

    def _recv_first(self, bufs: list[memoryview]) -> int:
        """One receive of what has arrived (at least a byte), scattered over ``bufs`` (not
        empty, none empty). Raises ConnectionError on EOF, TimeoutError after
        ``request_timeout`` without a byte."""
        try:
            n = self.sock.recv_into(bufs[0]) if len(bufs) == 1 \
                else self.sock.recvmsg_into(bufs)[0]
        except self.SILENT:
            raise self._timed_out() from None
        if n == 0:
            raise ConnectionError(f"node {self.address} closed the connection")
        return n

    def _recv_exact(self, view: memoryview) -> None:
        self._recv_all([view])

    def _recv_all(self, bufs: list[memoryview]) -> None:
        """Fill every buffer, in order, each receive asking for all that is left (up to
        IOV_MAX buffers) at once. Raises ConnectionError on EOF, TimeoutError after
        ``request_timeout`` without a byte."""
        bufs = [b for b in bufs if b.nbytes]
        while bufs:
            try:
                if len(bufs) == 1:
                    n = self.sock.recv_into(bufs[0], 0, socket.MSG_WAITALL)
                else:
                    n = self.sock.recvmsg_into(bufs[:IOV_MAX], 0, socket.MSG_WAITALL)[0]
            except BlockingIOError:
                raise self._timed_out() from None
            if n == 0:
                raise ConnectionError(f"node {self.address} closed the connection")
            advance(bufs, n)

    def _request(self, op: Op, count: int, meta: bytes,
                 payload: Sequence[memoryview] = ()) -> int:
        self._req_id += 1
        nbytes = sum(p.nbytes for p in payload)
        head = HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, op, self._req_id, count, len(meta), nbytes)
        self._send([memoryview(head + meta), *payload])
        return self._req_id

    def _head(self, op: Op, req_id: int) -> Header:
        self._recv_exact(self._header)
        head = unpack_header(self._header)
        if head.op != op | RESPONSE_BIT or head.req_id != req_id:
            raise ProtocolError(f"node {self.address} answered op {head.op} id {head.req_id} "
                                f"to op {int(op)} id {req_id}")
        return head

    def _meta(self, head: Header) -> bytes:
        """The answer's metadata; raises RemoteError for an error answer."""
        meta = bytearray(head.meta_len)
        self._recv_exact(memoryview(meta))
        if head.status != Status.OK:
            if head.payload_len:
                raise ProtocolError("error answer with a payload")
            raise error_for(head.status, meta.decode(errors="replace"))
        return bytes(meta)

    def _answer(self, op: Op, req_id: int) -> tuple[Header, bytes]:
        head = self._head(op, req_id)
        return head, self._meta(head)

    def call(self, op: Op, count: int = 0, meta: bytes = b"",
             payload: Sequence[memoryview] = ()) -> tuple[Header, bytes]:
        """One request without a payload in the answer."""
        head, answer = self._answer(op, self._request(op, count, meta, payload))
        if head.payload_len:
            raise ProtocolError(f"unexpected payload in the answer to {op.name}")
        return head, answer

    # ------------------------------------------------------------------ operations
    def declare(self, ns: Namespace) -> None:
        """Tell the node about a namespace once per connection. Raises AuthError if the
        token may not use its tenant."""
        if ns.id in self.declared:
            return
        head, answer = self.call(Op.NAMESPACE, meta=canonical_json(ns.canonical()))
        if answer != ns.id:
            raise ProtocolError(f"node {self.address} computed namespace id {answer.hex()}, "
                                f"expected {ns.id.hex()}")
        self.features = Feature(head.count & FEATURES)  # bits of later versions ignored
        self._get_touch = Feature.GET_TOUCH in self.features
        self.declared.add(ns.id)

    def ping(self) -> None:
        self.call(Op.PING)

    def exists_prefix(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        self.declare(ns)
        head, _ = self.call(Op.EXISTS_PREFIX, len(keys), pack_keys(ns.id, list(keys)))
        if head.count > len(keys):
            raise ProtocolError("EXISTS_PREFIX answered more keys than asked")
        return head.count

    def exists(self, ns: Namespace, keys: Sequence[bytes]) -> list[bool]:
        """Which of ``keys`` this node holds, one answer per key. A node older than EXISTS
        is asked EXISTS_PREFIX instead: its leading run counts as held, every key after it
        as not held (it may under-report, never over-report)."""
        return self.exists_flags(ns, keys).tolist()  # type: ignore[no-any-return]

    def exists_flags(self, ns: Namespace, keys: Sequence[bytes]) -> np.ndarray:
        """``exists`` as a bool array (no Python object per key). Raises ProtocolError for
        an answer that is not one 0/1 flag per key summing to its count."""
        self.declare(ns)
        meta = pack_keys(ns.id, list(keys))
        if self.features is not None and Feature.EXISTS_TOUCH in self.features:
            head, flags = self.call(Op.EXISTS, len(keys), meta)
            held = np.frombuffer(flags, dtype=np.uint8)
            if held.size != len(keys) or held.max(initial=0) > 1 \
                    or head.count != int(held.sum()):
                raise ProtocolError(f"malformed EXISTS answer from {self.address}")
            return held.astype(bool)
        run = self.call(Op.EXISTS_PREFIX, len(keys), meta)[0].count
        if run > len(keys):
            raise ProtocolError("EXISTS_PREFIX answered more keys than asked")
        return np.arange(len(keys)) < run

    def touch(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        """Ask the node to count ``keys`` as just read (eviction recency) without moving
        bytes; returns how many it holds. 0 without asking a node older than TOUCH."""
        self.declare(ns)
        if self.features is None or Feature.EXISTS_TOUCH not in self.features:
            return 0
        return self.call(Op.TOUCH, len(keys), pack_keys(ns.id, list(keys)))[0].count

    def get_into(self, ns: Namespace, keys: Sequence[bytes], outs: Sequence[Any],
                 touch: Sequence[bytes] = ()) -> list[bool]:
        """Fetch chunks into ``outs`` (each exactly ns.chunk_bytes, else ChunkSizeError, a
        ValueError). ``touch`` keys ride along to be touched, not fetched (dropped unasked on
        a node older than Feature.GET_TOUCH). A hit's buffer holds its chunk; a miss's is
        untouched when the whole answer fits the connection's inbox, else its contents are
        unspecified (it may hold bytes of a hit, received there before the flags said
        where they belong). Raises as ``get_views``."""
        views = [byte_view(o, writable=True) for o in outs]
        for view in views:
            if view.nbytes != ns.chunk_bytes:
                raise ChunkSizeError(f"output buffer has {view.nbytes} bytes; namespace chunks "
                                     f"have {ns.chunk_bytes}")
        return self.get_views(ns, keys, views, touch)

    def get_views(self, ns: Namespace, keys: Sequence[bytes], views: list[memoryview],
                  touch: Sequence[bytes] = ()) -> list[bool]:
        """``get_into`` for flat writable views of ns.chunk_bytes each, as the caller has
        checked them (ClusterClient). Raises OSError / TimeoutError / ProtocolError (the
        connection is then unusable) or RemoteError for the node's error answer."""
        ns_id, count = ns.id, len(keys)
        if ns_id not in self.declared:
            self.declare(ns)
        meta = ns_id + b"".join(keys) + (b"".join(touch) if touch and self._get_touch
                                          else b"")
        self._req_id += 1
        head = HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, Op.GET, self._req_id, count, len(meta), 0)
        self._send([memoryview(head + meta)])
        return self._get_answer(self._req_id, count, ns.chunk_bytes, views)

    def _get_answer(self, req_id: int, count: int, chunk: int,
                    views: list[memoryview]) -> list[bool]:
        """Receive a GET's answer: header, flags and payload.

        The first receive is one scatter ``recvmsg_into`` of what has arrived: into the inbox
        (header, flags and, when an answer of every key fits it, the whole answer; else the
        first SPECULATE_BYTES of the payload) and, for a larger chunk, on into the rest of
        the first key's buffer, where the first chunk of an answer whose first key hit
        belongs. Once the flags are read, the rest of the payload is received with one
        MSG_WAITALL scatter straight into the hits' buffers, and the payload the inbox holds
        is copied out. So a small answer is one receive, a large one usually two, and no
        step waits for the header alone.

        Every check holds before a hit is reported: the answer's id and op, flags of 0/1
        whose hits match the payload's length, no byte past the answer's end (ProtocolError:
        the connection is unusable and the caller counts misses). An error answer raises its
        RemoteError (ProtocolError when it carries a payload or its message does not fit
        the inbox). A node silent for ``request_timeout`` raises TimeoutError; a closed
        connection ConnectionError."""
        flags_end = HEADER_BYTES + count
        # cap: payload bytes the inbox takes (all of it when an answer of every key fits)
        cap = count * chunk if flags_end + count * chunk <= INBOX_BYTES else SPECULATE_BYTES
        box_end = max(flags_end + cap, HEADER_BYTES + ERROR_ROOM)
        box = self._inbox if box_end <= INBOX_BYTES else memoryview(bytearray(box_end))
        first = [box[:box_end]]
        if cap < chunk and count:  # a hit first key's chunk lands in place
            first.append(views[0][cap:])
        n = self._recv_first(first)
        if n < HEADER_BYTES:  # the header came in pieces
            advance(first, n)
            while n < HEADER_BYTES:
                got = self._recv_first(first)
                advance(first, got)
                n += got
        magic, version, status, op, rid, _, meta_len, payload_len = HEADER.unpack_from(box)
        if magic != MAGIC or version != PROTOCOL_VERSION or op != _GET_ANSWER or rid != req_id:
            raise ProtocolError(f"node {self.address} answered op {op} id {rid} (magic "
                                f"{bytes(magic)!r}, version {version}) to op {int(Op.GET)} "
                                f"id {req_id}")
        if status != Status.OK:
            end = HEADER_BYTES + meta_len
            if payload_len or end > box_end or n > end:
                raise ProtocolError(f"malformed error answer to a GET from {self.address}")
            self._recv_all([box[n:end]])
            raise error_for(status, bytes(box[HEADER_BYTES:end]).decode(errors="replace"))
        if meta_len != count or n > flags_end + payload_len:
            raise ProtocolError(f"malformed GET answer from {self.address}")
        if n < flags_end:
            self._recv_all([box[n:flags_end]])
            n = flags_end
        if count == 1 and box[HEADER_BYTES] <= 1:  # one key: no list of flags to parse
            found, hits = ([True], [0]) if box[HEADER_BYTES] else ([False], [])
        else:
            found = parse_flags(bytes(box[HEADER_BYTES:flags_end]), count)
            hits = [i for i, hit in enumerate(found) if hit]
        if payload_len != len(hits) * chunk:
            raise ProtocolError(f"malformed GET answer from {self.address}")
        got = n - flags_end  # payload bytes received so far
        in_box = min(cap, payload_len)
        rest = [box[n:flags_end + in_box]] if got < in_box else []
        if in_box < payload_len:
            j, off = divmod(in_box, chunk)
            if got > cap:  # landed in views[0][cap:]: the first hit's, wherever it goes
                if hits[0]:
                    views[hits[0]][cap:got] = views[0][cap:got]
                off = got
            rest.append(views[hits[j]][off:])
            rest.extend(views[i] for i in hits[j + 1:])
        if rest:
            self._recv_all(rest)
        at, end = flags_end, flags_end + in_box
        for i in hits:
            if at >= end:
                break
            take = min(chunk, end - at)
            views[i][:take] = box[at:at + take]
            at += take
        return found

    def put(self, ns: Namespace, keys: Sequence[bytes], datas: Sequence[Any]) -> int:
        views = [byte_view(d) for d in datas]
        self.declare(ns)
        head, _ = self.call(Op.PUT, len(keys), pack_keys(ns.id, list(keys)), views)
        return head.count

    def retain(self, ns: Namespace, keys: Sequence[bytes], retention: dict[str, Any]) -> int:
        """RETAIN: ask the node to keep ``keys`` as ``retention`` (a Retention's
        ``to_mapping``) says, sent before or after their PUT; keys recorded. 0 without asking
        a node older than Feature.RETENTION. Raises RemotePinLimitError (a PinLimitError) when
        the node refuses the pins."""
        self.declare(ns)
        if self.features is None or Feature.RETENTION not in self.features:
            return 0
        return self.call(Op.RETAIN, len(keys), pack_retain(ns.id, keys, retention))[0].count

    def release(self, ns: Namespace, session: str, delete: bool) -> int:
        """RELEASE: end ``session`` for the namespace's tenant on this node; chunks released
        (0 without asking a node older than Feature.RETENTION)."""
        self.declare(ns)
        if self.features is None or Feature.RETENTION not in self.features:
            return 0
        meta = ns.id + json.dumps({"session": session, "delete": delete}).encode()
        return self.call(Op.RELEASE, meta=meta)[0].count

    def delete(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        self.declare(ns)
        return self.call(Op.DELETE, len(keys), pack_keys(ns.id, list(keys)))[0].count

    def invalidate(self, ns: Namespace) -> int:
        self.declare(ns)
        return self.call(Op.INVALIDATE, meta=ns.id)[0].count

    def invalidate_id(self, ns_id: bytes) -> int:
        """INVALIDATE a namespace by its 16-byte id without declaring it (``kvpool admin
        invalidate``): copies dropped. Raises AuthError (FORBIDDEN) unless this token may
        (the admin token, auth off, or a tenant the node knows the namespace to be of);
        nodes older than this version answer RemoteError (UNKNOWN_NAMESPACE)."""
        if len(ns_id) != 16:
            raise ValueError("a namespace id is 16 bytes")
        return self.call(Op.INVALIDATE, meta=bytes(ns_id))[0].count

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.call(Op.STATS)[1])
        return result


class TlsNodeConnection(NodeConnection):
    """A NodeConnection over TLS (cluster.tls): the handshake verifies the node's certificate
    before any request (TlsHandshakeError, an OSError, if it does not verify). An SSL socket
    takes no receive flags and no sendmsg, and its timeouts are Python's (with kernel ones a
    blocking SSL read would retry forever): each buffer is sent whole and received in TLS
    records, and a node silent for ``request_timeout`` raises TimeoutError as on the plain
    path."""

    def __init__(self, address: str, token: str | None, connect_timeout: float,
                 request_timeout: float, socket_buffer_bytes: int, tls: ClientTls) -> None:
        self._tls = tls
        super().__init__(address, token, connect_timeout, request_timeout, socket_buffer_bytes)

    SILENT = (TimeoutError,)

    def _dial(self, connect_timeout: float, socket_buffer_bytes: int) -> socket.socket:
        sock = super()._dial(connect_timeout, socket_buffer_bytes)
        return self._tls.wrap(sock, parse_address(self.address)[0], self.address)

    def _set_timeouts(self, request_timeout: float) -> None:
        self.sock.settimeout(request_timeout)

    def _send(self, buffers: list[memoryview]) -> None:
        try:
            for buf in buffers:
                if buf.nbytes:
                    self.sock.sendall(buf)
        except TimeoutError:
            raise self._timed_out() from None

    def _recv_first(self, bufs: list[memoryview]) -> int:
        return super()._recv_first(bufs[:1])  # no scatter receive on an SSL socket

    def _recv_all(self, bufs: list[memoryview]) -> None:
        try:
            for buf in bufs:
                view = buf.cast("B") if buf.format != "B" else buf
                got = 0
                while got < view.nbytes:
                    n = self.sock.recv_into(view[got:])
                    if n == 0:
                        raise ConnectionError(f"node {self.address} closed the connection")
                    got += n
        except TimeoutError:
            raise self._timed_out() from None


def open_connection(address: str, token: str | None = None, connect_timeout: float = 0.5,
                    request_timeout: float = 5.0,
                    socket_buffer_bytes: int = _DEFAULTS.socket_buffer_bytes,
                    tls: ClientTls | None = None) -> NodeConnection:
    """A connection to the node at ``address``: over TLS when ``tls`` is given (never plain
    then), else plain TCP. Raises what the constructors raise (OSError, TlsHandshakeError,
    RemoteError for a refused token)."""
    if tls is None:
        return NodeConnection(address, token, connect_timeout, request_timeout,
                              socket_buffer_bytes)
    return TlsNodeConnection(address, token, connect_timeout, request_timeout,
                             socket_buffer_bytes, tls)


class NodePool:
    """Up to ``size`` idle connections to one node, shared by threads; over TLS when ``tls``
    is given."""

    def __init__(self, address: str, token: str | None, size: int, connect_timeout: float,
                 request_timeout: float, socket_buffer_bytes: int,
                 tls: ClientTls | None = None) -> None:
        self.address = address
        self._args = (token, connect_timeout, request_timeout, socket_buffer_bytes)
        self._tls = tls
        self._size = size
        self._idle: list[NodeConnection] = []
        self._lock = threading.Lock()

    def take(self) -> NodeConnection:
        """An idle connection, or a new one (raises OSError when the node refuses it). Hand
        it back with ``give_back`` after a clean exchange; close it after any failure."""
        return self.take_reused()[0]

    def take_reused(self) -> tuple[NodeConnection, bool]:
        """``take``, and whether the connection was an idle one (it may have been closed by
        the node since: a restarted node closed them all)."""
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        if self._tls is None:
            return NodeConnection(self.address, *self._args), False
        return TlsNodeConnection(self.address, *self._args, self._tls), False

    def give_back(self, conn: NodeConnection) -> None:
        """Keep ``conn`` for the next exchange (closed when the pool is full)."""
        with self._lock:
            if len(self._idle) < self._size:
                self._idle.append(conn)
                return
        conn.close()

    @contextmanager
    def connection(self) -> Iterator[NodeConnection]:
        """A connection for one exchange. On any exception it is closed, not reused."""
        conn = self.take()
        try:
            yield conn
        except BaseException:
            conn.close()
            raise
        self.give_back(conn)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
