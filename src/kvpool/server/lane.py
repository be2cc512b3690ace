"""A lane: a thread that serves one connection of a storage node with blocking socket calls,
as a thread-per-connection server does, instead of the event loop.

A connection that has moved a payload of at least ``server.offload_bytes`` is handed to a
lane (up to ``server.lane_connections`` at once; the rest stay on the loop). On the loop a
large answer costs a hand-off to a network thread and back per request, several thread
wake-ups and an epoll round per receive; on a lane a GET is one blocking receive of the
header, one of the keys and one ``sendmsg`` of the pinned views, with the GIL released in
each. GETs and PUTs are served on the lane (``NodeStore.get_blocking``, ``begin_put_blocking``
and ``commit_put_blocking``: lower-tier reads, waits for slots and durable syncs block only
this connection), and so are the existence probes (``exists_now``, ``exists_prefix_now``:
index lookups under the tiers' locks, which are never held across IO); every other request
is handed back to the event loop with the socket (made non-blocking again for the while),
and answered there exactly as before.

Failure contract: the same as connection.py's. The sweeper cuts off an idle or stalled peer
by shutting the socket down, which ends the lane's blocking call; bytes that are not a frame,
a frame over the limits or any unexpected exception end this connection only (the exception
reaches ``Connection.serve``, which counts it as for a connection on the loop). When the
node stops, the connection's task is cancelled: the lane's socket is shut down and the task
waits for the thread to end before the session is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable, Coroutine, Sequence
from time import perf_counter
from typing import TYPE_CHECKING, Any

from kvpool.buffers import advance
from kvpool.net.protocol import (
    HEADER_BYTES,
    Header,
    Op,
    answer_frame,
    pack_flags,
    split_get_keys,
    split_keys,
    unpack_header,
)
from kvpool.server.store import Refused
from kvpool.server.traffic import DISCARD_BYTES, IOV_MAX

if TYPE_CHECKING:
    from kvpool.server.connection import Connection


#: The lane's receive buffer: a request's header and up to ~1,000 keys in one receive.
INBOX_BYTES = 16 << 10


class Lane:
    """Serves ``conn`` on a lane thread until the peer leaves, a request ends the connection
    or the node drains. The caller has taken the lane (``Traffic.take_lane``); ``run`` gives
    it back."""

    #: Flags of a payload's receive: all of it in one call (an SSL socket takes none).
    PAYLOAD_RECV_FLAGS: int = socket.MSG_WAITALL

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.sock = conn.sock
        # Received bytes not yet consumed: a request's header and keys arrive together, so
        # one receive into here serves both (one syscall a request, not two).
        self._inbox = memoryview(bytearray(INBOX_BYTES))
        self._have = self._used = 0

    async def run(self) -> None:
        """Serve on a lane thread and wait for it; raises what serving raised."""
        traffic = self.conn.traffic
        done = asyncio.wrap_future(traffic.lane_executor.submit(self._serve))
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)  # ends the thread's blocking call
            await asyncio.wait([done])
            if not done.cancelled():
                done.exception()  # the shut socket's error, expected: retrieved, not logged
            raise
        finally:
            traffic.lanes -= 1

    # ------------------------------------------------------------------ on the lane thread
    def _serve(self) -> None:
        traffic = self.conn.traffic
        header = memoryview(bytearray(HEADER_BYTES))
        self.sock.setblocking(True)
        while True:
            self._recv(header)
            req = unpack_header(header)
            traffic.begin()
            try:
                keep = self._handle(req)
            finally:
                traffic.end()
            if not keep or traffic.draining:
                return

    def _handle(self, req: Header) -> bool:
        conn = self.conn
        op = conn.check(req)
        started = perf_counter()
        meta = memoryview(bytearray(req.meta_len))
        self._recv(meta)
        if conn.refusal is None and conn.session.authenticated:
            if op is Op.GET:
                return self._here(req, "get", started, self._get, meta)
            if op is Op.PUT:
                return self._here(req, "put", started, self._put, meta)
            if op is Op.EXISTS_PREFIX:
                return self._here(req, "exists_prefix", started, self._exists_prefix, meta)
            if op is Op.EXISTS:
                return self._here(req, "exists", started, self._exists, meta)
        return self._on_loop(conn.answer(op, req, meta, started))

    def _on_loop(self, answer: Coroutine[Any, Any, bool]) -> bool:
        """Run ``answer`` on the event loop with the socket back in non-blocking mode."""
        self.sock.setblocking(False)
        try:
            return asyncio.run_coroutine_threadsafe(answer, self.conn.loop).result()
        finally:
            self.sock.setblocking(True)

    def _here(self, req: Header, name: str, started: float,
              serve: Callable[[Header, memoryview], None], meta: memoryview) -> bool:
        """Serve a request on this thread, counted and timed as Connection.answer does; a
        refusal is answered and keeps the connection unless it says otherwise."""
        conn = self.conn
        conn.count(f"op_{name}")
        try:
            serve(req, meta)
        except Refused as refused:
            conn.count_refused(refused)
            self._send(answer_frame(req, refused.status, meta=refused.message.encode()))
            return not refused.close
        finally:
            conn.record_latency(name, started)
        return True

    def _get(self, req: Header, meta: memoryview) -> None:
        conn = self.conn
        ns_id, keys, touch = split_get_keys(meta, req.count)
        answer = conn.store.get_blocking(conn.session, ns_id, keys, touch)
        try:
            self._send(answer_frame(req, count=len(answer.views), meta=answer.flags,
                                    payload=answer.views))
        finally:
            answer.release()

    def _put(self, req: Header, meta: memoryview) -> None:
        self.conn.receiving = True  # server.payload_stall_timeout_s applies
        try:
            self._receive_put(req, meta)
        finally:
            self.conn.receiving = False

    def _receive_put(self, req: Header, meta: memoryview) -> None:
        conn = self.conn
        ns_id, keys = split_keys(meta, req.count)
        try:
            conn.refuse_put_if_stopping()
            batch = conn.store.begin_put_blocking(conn.session, ns_id, keys, req.payload_len)
        except Refused:
            self._discard(req.payload_len)  # the frame stays in step; then answer
            raise
        try:
            for target in batch.targets:
                if target is None:
                    self._discard(batch.ns.chunk_bytes)
                else:
                    self._recv(target)
            conn.receiving = False  # all arrived; a durable commit's sync is not a stall
            stored = conn.store.commit_put_blocking(batch)
        finally:
            batch.abort()
        self._send(answer_frame(req, count=stored))

    def _exists_prefix(self, req: Header, meta: memoryview) -> None:
        conn = self.conn
        ns_id, keys = split_keys(meta, req.count)
        self._send(answer_frame(req, count=conn.store.exists_prefix_now(conn.session, ns_id,
                                                                        keys)))

    def _exists(self, req: Header, meta: memoryview) -> None:
        conn = self.conn
        ns_id, keys = split_keys(meta, req.count)
        held = conn.store.exists_now(conn.session, ns_id, keys)
        self._send(answer_frame(req, count=sum(held), meta=pack_flags(held)))

    def _discard(self, nbytes: int) -> None:
        scratch = memoryview(bytearray(min(nbytes, DISCARD_BYTES)))
        while nbytes:
            part = scratch[:min(nbytes, scratch.nbytes)]
            self._recv(part)
            nbytes -= part.nbytes

    def _recv(self, view: memoryview) -> None:
        """Fill ``view``: first from the inbox, then, for what is left, one receive of up to
        INBOX_BYTES into the inbox when that is small (a header, keys: whatever else came
        with them stays there for the next call), or straight into ``view`` when it is large
        (a payload). Raises ConnectionError on EOF (or a socket the sweeper shut)."""
        got = min(view.nbytes, self._have - self._used)
        if got:
            view[:got] = self._inbox[self._used:self._used + got]
            self._used += got
        while got < view.nbytes:
            want = view.nbytes - got
            if want < INBOX_BYTES:
                n = self.sock.recv_into(self._inbox, INBOX_BYTES)
                take = min(n, want)
                view[got:got + take] = self._inbox[:take]
                self._have, self._used = n, take
            else:
                n = take = self.sock.recv_into(view[got:], 0, self.PAYLOAD_RECV_FLAGS)
            if n == 0:
                raise ConnectionError("peer closed the connection")
            got += take
            self.conn.last_io = time.monotonic()

    def _send(self, buffers: Sequence[bytes | memoryview]) -> None:
        bufs = [memoryview(b).cast("B") for b in buffers if len(b)]
        while bufs:
            advance(bufs, self.sock.sendmsg(bufs[:IOV_MAX]))
            self.conn.last_io = time.monotonic()
