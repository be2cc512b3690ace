"""One client connection of a storage node: reads frames, runs them against the pool, answers.

Requests on a connection are served in order (a client gets parallelism from several
connections). Payloads move without staging copies: a PUT payload is received with
``recv_into`` straight into reserved DRAM slots, and a GET answer is sent with one
scatter-gather ``sendmsg`` from pinned DRAM slots (SSD hits are read into a per-request
buffer first).

Failure contract: a request the node can answer wrongly-but-safely (unknown namespace,
forbidden tenant, too many bytes for one answer) gets an error response and the connection
stays open. Bytes that are not a frame, a frame over the limits, an idle or stalled peer, a
peer that has not completed AUTH within ``server.auth_timeout_s`` (whatever it trickles), or
any unexpected exception close this connection only; the node keeps serving.

A connection accepted over ``server.max_connections`` is a refusal: its first request is
answered BUSY and it is closed. A (re-)AUTH starts a new identity: the namespaces declared
before it are dropped, so they must be declared again under the new token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import select
import socket
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import xxhash

from kvpool.buffers import advance
from kvpool.config import ServerConfig
from kvpool.keys import KEY_BYTES, Namespace
from kvpool.net.protocol import (
    FEATURES,
    HEADER_BYTES,
    KEYED_OPS,
    NS_BYTES,
    RESPONSE_BIT,
    Header,
    Op,
    ProtocolError,
    Status,
    pack_flags,
    split_get_keys,
    split_keys,
    unpack_header,
)
from kvpool.pool import ChunkReservation, KVPool
from kvpool.server.registry import RegistryFull
from kvpool.tiers.dram import PinnedView

if TYPE_CHECKING:
    from kvpool.server.node import StorageNode

log = logging.getLogger("kvpool.serve")

_SMALL_META = 64 * 1024  # AUTH / NAMESPACE metadata
_DISCARD = 1 << 20
IOV_MAX = 512
#: Namespaces one connection may declare (bounds per-connection memory).
MAX_NAMESPACES = 256
#: Transfers at least this large run on a network thread instead of the event loop.
OFFLOAD_BYTES = 512 * 1024


class _Refused(Exception):
    """A request answered with an error status; ``close`` ends the connection afterwards."""

    def __init__(self, status: Status, message: str, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.close = status, message, close


def scoped_chunk_key(ns_id: bytes, key: bytes) -> bytes:
    """The key a node files a client's chunk key under: scoped by namespace, so a key
    presented under another tenant's namespace can never reach this one's bytes."""
    return bytes(xxhash.xxh3_128_digest(ns_id + key))


class Connection:
    """``refusal``: answer the first request BUSY with this message, then close."""

    def __init__(self, node: StorageNode, sock: socket.socket,
                 refusal: str | None = None) -> None:
        self.node = node
        self.sock = sock
        self.cfg: ServerConfig = node.config.server
        self.pool: KVPool = node.pool
        self.executor: ThreadPoolExecutor = node.executor
        self.loop = asyncio.get_running_loop()
        self.tenants: frozenset[str] | None = None if node.auth.enabled else frozenset()
        self.admin = False  # AUTH with server.admin_token: node-wide STATS
        self.refusal = refusal
        self.namespaces: dict[bytes, Namespace] = {}  # each holds a reference in the registry
        self.peer = _peer_name(sock)
        self.last_io = self.loop.time()  # the node's sweeper closes idle or stalled peers
        self.accepted = self.last_io
        self.cut_off: str | None = None  # why the sweeper closed it (a counter's name)

    # ------------------------------------------------------------------ socket helpers
    async def recv_exact(self, view: memoryview) -> None:
        """Fill ``view`` from the socket. Raises ConnectionError on EOF. While other requests
        are in flight, large payloads are received on a network thread: the copy out of the
        kernel releases the GIL, so several connections move bytes on several cores and the
        loop stays responsive. A lone request skips the thread hop."""
        if view.nbytes >= OFFLOAD_BYTES and self.node.busy:
            await self.loop.run_in_executor(self.node.net_executor, self._recv_blocking, view)
            self.last_io = self.loop.time()
            return
        got = 0
        while got < view.nbytes:
            n = await self.loop.sock_recv_into(self.sock, view[got:])
            if n == 0:
                raise ConnectionError("peer closed the connection")
            got += n
            self.last_io = self.loop.time()

    async def discard(self, nbytes: int) -> None:
        scratch = memoryview(bytearray(min(nbytes, _DISCARD)))
        while nbytes:
            part = scratch[:min(nbytes, scratch.nbytes)]
            await self.recv_exact(part)
            nbytes -= part.nbytes

    def close_if_idle(self, now: float) -> None:
        """Called by the node's sweeper: a peer silent (or stalled mid-frame) for longer than
        server.idle_timeout_s, or one still unauthenticated (or refused) server.auth_timeout_s
        after it was accepted, is cut off; its pending receive fails and serve() returns."""
        if self.cut_off is not None:
            return
        if now - self.last_io > self.cfg.idle_timeout_s:
            self.cut_off = "idle_closed"
        elif (self.tenants is None or self.refusal is not None) and \
                now - self.accepted > self.cfg.auth_timeout_s:
            self.cut_off = "auth_timeouts"
        else:
            return
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _wait(self, events: int) -> None:
        poller = select.poll()
        poller.register(self.sock, events | select.POLLERR | select.POLLHUP)
        if not poller.poll(self.cfg.idle_timeout_s * 1000):
            raise TimeoutError("peer stalled mid-transfer")

    def _recv_blocking(self, view: memoryview) -> None:
        got = 0
        while got < view.nbytes:
            try:
                n = self.sock.recv_into(view[got:])
            except BlockingIOError:
                self._wait(select.POLLIN)
                continue
            if n == 0:
                raise ConnectionError("peer closed the connection")
            got += n

    def _send_blocking(self, bufs: list[memoryview]) -> None:
        while bufs:
            try:
                sent = self.sock.sendmsg(bufs[:IOV_MAX])
            except BlockingIOError:
                self._wait(select.POLLOUT)
                continue
            advance(bufs, sent)

    async def send(self, buffers: Sequence[bytes | memoryview]) -> None:
        """Scatter-gather send of every buffer, in order; large answers go out from a network
        thread (see recv_exact)."""
        bufs = [memoryview(b).cast("B") for b in buffers if len(b)]
        if sum(b.nbytes for b in bufs) >= OFFLOAD_BYTES and self.node.busy:
            await self.loop.run_in_executor(self.node.net_executor, self._send_blocking, bufs)
            self.last_io = self.loop.time()
            return
        while bufs:
            try:
                sent = self.sock.sendmsg(bufs[:IOV_MAX])
            except BlockingIOError:
                sent = 0
            advance(bufs, sent)
            if bufs and not sent:
                # The socket buffer is full: let the loop wait until the first piece is out.
                await self.loop.sock_sendall(self.sock, bufs.pop(0))
            self.last_io = self.loop.time()

    async def reply(self, req: Header, status: Status = Status.OK, count: int = 0,
                    meta: bytes = b"", payload: Sequence[memoryview] = ()) -> None:
        nbytes = sum(p.nbytes for p in payload)
        head = Header(req.op | RESPONSE_BIT, req.req_id, count, len(meta), nbytes, status)
        await self.send([head.pack() + meta, *payload])

    # ------------------------------------------------------------------ main loop
    async def serve(self) -> None:
        header_buf = memoryview(bytearray(HEADER_BYTES))
        try:
            while True:
                await self.recv_exact(header_buf)
                req = unpack_header(header_buf)
                self.node.begin_request()
                try:
                    keep = await self.handle(req)
                finally:
                    self.node.end_request()
                if not keep or self.node.draining:
                    return
        except ProtocolError as exc:
            self.node.count("protocol_errors")
            log.info("closing %s: %s", self.peer, exc)
        except (ConnectionError, OSError):
            if self.cut_off is not None:
                self.node.count(self.cut_off)
        except Exception:  # never let one connection take the node down
            self.node.count("internal_errors")
            log.exception("closing %s after an unexpected error", self.peer)
        finally:
            self._drop_namespaces()

    def _drop_namespaces(self) -> None:
        for ns in self.namespaces.values():
            self.node.namespaces.release(ns)
        self.namespaces.clear()

    async def handle(self, req: Header) -> bool:
        """Serve one request; False when the connection must close afterwards."""
        try:
            op = Op(req.op)
        except ValueError:
            raise ProtocolError(f"unknown opcode {req.op}") from None
        self._check_limits(op, req)
        meta = memoryview(bytearray(req.meta_len))
        await self.recv_exact(meta)
        self.node.count(f"op_{op.name.lower()}")
        try:
            if self.refusal is not None:
                raise _Refused(Status.BUSY, self.refusal, close=True)
            if op is not Op.AUTH and self.tenants is None:
                raise _Refused(Status.AUTH_REQUIRED, "this node requires AUTH first", close=True)
            await self._dispatch(op, req, meta)
        except _Refused as refused:
            self.node.count("refused")
            await self.reply(req, refused.status, meta=refused.message.encode())
            return not refused.close
        return True

    def _check_limits(self, op: Op, req: Header) -> None:
        cfg = self.cfg
        keyed = op in KEYED_OPS
        max_meta = NS_BYTES + cfg.max_keys * KEY_BYTES if keyed else _SMALL_META
        if req.is_response or req.status:
            raise ProtocolError("a request must not carry a status or the response bit")
        if req.meta_len > max_meta:
            raise ProtocolError(f"{op.name} metadata of {req.meta_len} bytes exceeds {max_meta}")
        if req.count > cfg.max_keys:
            raise ProtocolError(f"{op.name} with {req.count} keys exceeds max_keys "
                                f"{cfg.max_keys}")
        if req.payload_len and op is not Op.PUT:
            raise ProtocolError(f"{op.name} must not carry a payload")
        if req.meta_len + req.payload_len > cfg.max_frame_bytes:
            raise ProtocolError(f"frame of {req.meta_len + req.payload_len} bytes exceeds "
                                f"max_frame_bytes {cfg.max_frame_bytes}")

    async def _dispatch(self, op: Op, req: Header, meta: memoryview) -> None:
        if op is Op.AUTH:
            await self._auth(req, meta)
        elif op is Op.PING:
            await self.reply(req)
        elif op is Op.NAMESPACE:
            await self._namespace(req, meta)
        elif op is Op.STATS:
            stats = await self.node.stats_for(self)
            await self.reply(req, meta=json.dumps(stats, default=str).encode())
        elif op is Op.INVALIDATE:
            if req.meta_len != NS_BYTES:
                raise ProtocolError("INVALIDATE metadata must be one namespace id")
            ns = self._namespace_of(bytes(meta))
            dropped = await self.loop.run_in_executor(self.executor, self.pool.invalidate, ns)
            await self.reply(req, count=dropped)
        else:
            touch: list[bytes] = []
            if op is Op.GET:
                ns_id, keys, touch = split_get_keys(meta, req.count)
            else:
                ns_id, keys = split_keys(meta, req.count)
            if op is Op.PUT:
                await self._put(req, ns_id, keys)
                return
            ns = self._namespace_of(ns_id)
            scoped = [scoped_chunk_key(ns_id, k) for k in keys]
            if op is Op.EXISTS_PREFIX:
                await self.reply(req, count=self.pool.lookup(ns, scoped))
            elif op is Op.EXISTS:
                await self._exists(req, ns, scoped)
            elif op is Op.TOUCH:
                await self.reply(req, count=self.pool.touch(ns, scoped))
            elif op is Op.GET:
                if touch:  # in-memory, and never waits on the SSD lock: done on the loop
                    self.pool.touch(ns, [scoped_chunk_key(ns_id, k) for k in touch])
                await self._get(req, ns, scoped)
            else:
                removed = await self.loop.run_in_executor(
                    self.executor, lambda: sum(self.pool.delete(ns, k) for k in scoped))
                await self.reply(req, count=removed)

    # ------------------------------------------------------------------ ops
    async def _auth(self, req: Header, meta: memoryview) -> None:
        # A new identity starts with nothing declared: what the previous token declared
        # must not stay reachable under this one.
        self._drop_namespaces()
        auth = self.node.auth
        if not auth.enabled:
            self.tenants = frozenset()
            await self.reply(req, meta=self._hello(["*"]))
            return
        self.tenants, self.admin = None, False
        token = bytes(meta)
        if auth.is_admin(token):
            self.tenants, self.admin = frozenset(), True
            await self.reply(req, meta=self._hello([]))
            return
        tenants = auth.tenants_for(token)
        if tenants is None:
            self.node.count("auth_failures")
            raise _Refused(Status.AUTH_FAILED, "unknown token", close=True)
        self.tenants = tenants
        await self.reply(req, meta=self._hello(sorted(tenants)))

    def _hello(self, tenants: list[str]) -> bytes:
        return json.dumps({"node_id": self.node.node_id, "tenants": tenants,
                           "admin": self.admin}).encode()

    async def _namespace(self, req: Header, meta: memoryview) -> None:
        try:
            ns = Namespace.from_canonical(json.loads(bytes(meta)))
        except (ValueError, UnicodeDecodeError) as exc:
            raise _Refused(Status.BAD_REQUEST, f"bad namespace: {exc}") from None
        if self.node.auth.enabled and ns.tenant not in (self.tenants or ()):
            raise _Refused(Status.FORBIDDEN, f"namespace of tenant {ns.tenant!r} is not "
                           "allowed for this token")
        if ns.chunk_bytes > self.cfg.max_item_bytes:
            raise _Refused(Status.TOO_LARGE, f"chunks of {ns.chunk_bytes} bytes exceed "
                           f"max_item_bytes {self.cfg.max_item_bytes}")
        if ns.id not in self.namespaces:
            if len(self.namespaces) >= MAX_NAMESPACES:
                raise _Refused(Status.BAD_REQUEST, f"more than {MAX_NAMESPACES} namespaces on "
                               "one connection")
            try:
                self.node.namespaces.acquire(ns)
            except RegistryFull as exc:
                self.node.count("namespaces_refused")
                raise _Refused(Status.BUSY, str(exc)) from None
            except ValueError as exc:
                raise _Refused(Status.TOO_LARGE, str(exc)) from None
            self.namespaces[ns.id] = ns
            self.node.count_tenant(ns.tenant, "namespaces_declared")
        await self.reply(req, count=FEATURES, meta=ns.id)

    def _namespace_of(self, ns_id: bytes) -> Namespace:
        ns = self.namespaces.get(ns_id)
        if ns is None:
            raise _Refused(Status.UNKNOWN_NAMESPACE, f"namespace {ns_id.hex()} was not "
                           "declared on this connection since its last AUTH (send NAMESPACE "
                           "first)")
        self.node.count_tenant(ns.tenant, "requests")
        return ns

    async def _put(self, req: Header, ns_id: bytes, keys: list[bytes]) -> None:
        ns = self.namespaces.get(ns_id)
        if ns is None:
            await self.discard(req.payload_len)
            self._namespace_of(ns_id)  # raises the error response
            return
        if req.payload_len != len(keys) * ns.chunk_bytes:
            raise ProtocolError(f"PUT payload of {req.payload_len} bytes is not {len(keys)} "
                                f"chunks of {ns.chunk_bytes}")
        scoped = [scoped_chunk_key(ns_id, k) for k in keys]
        # Slots are taken on the loop when that cannot block; only a batch that would wait
        # for pinned slots goes to a worker thread.
        tried = [self.pool.reserve(ns, k, wait=False) for k in scoped]
        slots: list[ChunkReservation | bool] = [s for s in tried if s is not None]
        if len(slots) < len(tried):
            for slot in slots:
                if not isinstance(slot, bool):
                    slot.abort()
            slots = await self.loop.run_in_executor(
                self.executor, lambda: [bool(s) if s is None else s
                                        for s in (self.pool.reserve(ns, k) for k in scoped)])
        stored = 0
        received: list[ChunkReservation] = []
        try:
            for slot in slots:
                if isinstance(slot, bool):
                    await self.discard(ns.chunk_bytes)
                    stored += slot
                else:
                    await self.recv_exact(slot.view)
                    received.append(slot)
            if self.pool.durable_puts:
                # Acknowledged = on the SSD and synced: one write and sync for the batch, on
                # a worker thread (an fdatasync must never stall the event loop).
                stored += await self.loop.run_in_executor(self.executor, self.pool.commit_many,
                                                          received)
            else:
                stored += self.pool.commit_many(received)
        finally:
            for slot in slots:
                if not isinstance(slot, bool):
                    slot.abort()  # a half-received chunk is never published (no-op if done)
        self.node.count("put_chunks", stored)
        self.node.count_tenant(ns.tenant, "requests")
        self.node.count_tenant(ns.tenant, "put_chunks", stored)
        self.node.count_tenant(ns.tenant, "put_bytes", stored * ns.chunk_bytes)
        await self.reply(req, count=stored)

    async def _exists(self, req: Header, ns: Namespace, keys: list[bytes]) -> None:
        """One flag per key. The probes are in-memory index lookups, but the SSD index lock
        can be held across a segment roll: while other requests are in flight they run on a
        worker thread so the loop keeps serving; a lone request answers inline."""
        if self.node.busy:
            held = await self.loop.run_in_executor(self.executor, self.pool.contains_many, ns,
                                                   keys)
        else:
            held = self.pool.contains_many(ns, keys)
        await self.reply(req, count=sum(held), meta=pack_flags(held))

    async def _get(self, req: Header, ns: Namespace, keys: list[bytes]) -> None:
        if len(keys) * ns.chunk_bytes > self.cfg.max_inflight_bytes:
            raise _Refused(Status.TOO_LARGE, f"{len(keys)} chunks of {ns.chunk_bytes} bytes "
                           f"exceed max_inflight_bytes {self.cfg.max_inflight_bytes}; "
                           "split the batch")
        pins: list[PinnedView | None] = self.pool.pin_many(ns, keys)
        try:
            payload: list[memoryview | None] = [p.data if p is not None else None for p in pins]
            missing = [i for i, p in enumerate(pins) if p is None]
            if missing:
                bufs = [memoryview(bytearray(ns.chunk_bytes)) for _ in missing]
                found = await self.loop.run_in_executor(
                    self.executor, self.pool.get_many_into, ns, [keys[i] for i in missing],
                    bufs)
                for i, buf, hit in zip(missing, bufs, found, strict=True):
                    payload[i] = buf if hit else None
            flags = bytes(p is not None for p in payload)
            views = [p for p in payload if p is not None]
            self.node.count("get_hits", len(views))
            self.node.count("get_misses", len(keys) - len(views))
            self.node.count_tenant(ns.tenant, "get_hits", len(views))
            self.node.count_tenant(ns.tenant, "get_misses", len(keys) - len(views))
            self.node.count_tenant(ns.tenant, "get_bytes", len(views) * ns.chunk_bytes)
            await self.reply(req, count=len(views), meta=flags, payload=views)
        finally:
            for pin in pins:
                if pin is not None:
                    pin.release()


def _peer_name(sock: socket.socket) -> str:
    try:
        peer: Any = sock.getpeername()
        return f"{peer[0]}:{peer[1]}"
    except OSError:
        return "<unknown peer>"
