"""The host pool (``kvpool host``): the tenants' pools behind a Unix socket that the host's
engine processes attach to.

One thread per attached connection (blocking reads; an engine's requests are served in the
order it sent them), one accept thread. An attach: the peer's uid (SO_PEERCRED) must be
allowed (tenants.peer_allowed), then its HELLO's token must name its tenant
(tenants.tenant_for); only then is the tenant's arena sent, as a file descriptor. A refused
attach is answered ``ok: false`` with the reason and closed.

Failure contract: a connection that breaks the format, goes silent mid-frame (a large
frame's body must arrive within host.request_timeout_s), or whose peer dies (SIGKILL
included) is closed and its session released (pins, reservations); nothing else notices.
Greedy peers are bounded: connections past host.max_connections are answered busy and
closed; large frames past host.max_receive_bytes (over every connection) close their
connection; out of descriptors, the accept thread backs off until one is freed.

``stop`` closes the listener, every connection and every tenant's pool (the
write-behind queues drain to SSD), then the KV event publisher (host/events.py); the socket
file is removed. A host pool killed -9 leaves its socket file behind: the next start finds
nobody answering on it and replaces it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import struct
import threading
import time
from pathlib import Path

from kvpool.config import Config
from kvpool.errors import KVPoolError
from kvpool.events.attach import bind_error
from kvpool.host import wire
from kvpool.host.events import start_host_events
from kvpool.host.session import Session
from kvpool.host.tenants import AttachRefused, Tenants, peer_allowed, tenant_for

log = logging.getLogger("kvpool.host")
_UCRED = struct.Struct("3i")  # pid, uid, gid


class HostStartError(KVPoolError):
    """The host pool cannot start for a reason the operator can fix (message: one line)."""


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, from the kernel (SO_PEERCRED)."""
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                  _UCRED.size))
    return pid, uid, gid


def _claim_socket_path(path: Path) -> None:
    """Remove a stale socket file a killed host pool left; HostStartError if a host pool
    answers there, or the path is something else than a socket."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise HostStartError(f"host.socket={path}: exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()  # nobody listens: left by a host pool that died
        return
    finally:
        probe.close()
    raise HostStartError(f"host.socket={path}: another host pool is listening there")


def _hello_is_small(size: int) -> None:
    """``recv_frame``'s admit before an attach: a HELLO is a few hundred bytes."""
    raise wire.WireError(f"a {size}-byte message before the attach (a hello is small)")


class HostServer:
    """Listens on ``config.host.socket``. Raises HostStartError (socket taken, no DRAM, an
    events port that cannot be bound), OSError (cannot bind the socket)."""

    def __init__(self, config: Config) -> None:
        if not config.host.socket:
            raise HostStartError("host.socket: set it to the Unix socket path engines attach to")
        self.config = config
        self.path = Path(config.host.socket)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _claim_socket_path(self.path)
        try:
            self.tenants = Tenants(config)
        except ValueError as exc:
            raise HostStartError(str(exc)) from None
        try:  # KV events of every tenant's pool, through one publisher (docs/routing.md)
            self.events = start_host_events(config, self.tenants)
        except Exception as exc:  # zmq.ZMQError: a port taken, an address not ours
            self.tenants.close()
            raise HostStartError(bind_error(config.events, exc)) from None
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.listener.bind(str(self.path))
        except BaseException:
            self.listener.close()
            self._close_pools()
            raise
        # Anyone may connect; SO_PEERCRED and the token decide who attaches.
        os.chmod(self.path, 0o666)
        self.listener.listen(128)
        self._connections: dict[int, socket.socket] = {}
        self._lock = threading.Lock()
        self._receiving = 0  # bytes of large frames admitted (host.max_receive_bytes)
        self._warned: dict[str, float] = {}
        self.refused_busy = 0  # connections past host.max_connections
        self.refused_frames = 0  # large frames past host.max_receive_bytes
        self._stopped = threading.Event()
        self._accepter = threading.Thread(target=self._accept_loop, name="kvpool-host-accept",
                                          daemon=True)

    def start(self) -> HostServer:
        self._accepter.start()
        return self

    def readiness(self) -> str | None:
        """None while attaches are served (``/readyz``), else why not."""
        return "stopping" if self._stopped.is_set() else None

    def _accept_loop(self) -> None:
        host = self.config.host
        while not self._stopped.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError as exc:
                if self._stopped.is_set():
                    return
                # Out of descriptors (or memory): the pending connection waits in the
                # backlog; back off instead of spinning on accept until one is freed.
                self._warn("accept_failed", f"accept failed: {exc}; retrying")
                self._stopped.wait(0.05)
                continue
            with self._lock:
                busy = len(self._connections) >= host.max_connections
                if not busy:
                    self._connections[conn.fileno()] = conn
            if busy:
                self._refuse_busy(conn)
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kvpool-host-conn",
                             daemon=True).start()

    def _refuse_busy(self, conn: socket.socket) -> None:
        """A connection past host.max_connections: ``ok: false`` (busy), closed at once."""
        self.refused_busy += 1
        limit = self.config.host.max_connections
        error = f"busy: the host pool serves host.max_connections={limit}"
        self._warn("connections_busy", f"connection refused: {error}")
        with contextlib.suppress(OSError):
            conn.setblocking(False)  # a peer that does not read cannot hold the accept thread
            wire.send_frame(conn, {"ok": False, "error": error})
        conn.close()

    def _warn(self, event: str, message: str) -> None:
        """One warning per event per 10 s: a flood must not flood the log as well."""
        now = time.monotonic()
        with self._lock:  # accept and connection threads warn at once
            due = now - self._warned.get(event, -1e9) >= 10.0
            if due:
                self._warned[event] = now
        if due:
            log.warning(message, extra={"event": event})

    def _admit(self, size: int) -> None:
        """Take ``size`` bytes of host.max_receive_bytes for a large frame; WireError when
        they are not there (the frame's connection is closed)."""
        with self._lock:
            if self._receiving + size > self.config.host.max_receive_bytes:
                self.refused_frames += 1
                refused = True
            else:
                self._receiving += size
                refused = False
        if refused:
            self._warn("receive_busy", f"a {size}-byte message was refused: "
                       "host.max_receive_bytes is taken; its connection is closed")
            raise wire.WireError(f"busy: no room for a {size}-byte message "
                                 "(host.max_receive_bytes)")

    def _release(self, size: int) -> None:
        with self._lock:
            self._receiving -= size

    def _attach(self, conn: socket.socket) -> Session | None:
        """The HELLO exchange; None (answered and to be closed) when refused."""
        host = self.config.host
        conn.settimeout(host.request_timeout_s)
        pid, uid, _ = peer_credentials(conn)
        try:
            meta, _, _ = wire.recv_frame(conn, 0, admit=_hello_is_small)
            if not peer_allowed(self.config, uid):
                raise AttachRefused(f"uid {uid} may not attach (host.allowed_uids)")
            if meta.get("op") != wire.HELLO:
                raise AttachRefused("the first request must be hello")
            if meta.get("version") != wire.VERSION:
                raise AttachRefused(
                    f"the engine speaks host wire version {meta.get('version')}, this host "
                    f"pool {wire.VERSION}: run the same kvpool release in both")
            token, tenant = meta.get("token"), meta.get("tenant")
            name = tenant_for(self.config, token if isinstance(token, str) else None,
                              tenant if isinstance(tenant, str) else "")
            pool = self.tenants.get(name)
        except (AttachRefused, OSError, ValueError, KVPoolError) as exc:
            log.warning("attach refused (pid %d, uid %d): %s", pid, uid, exc,
                        extra={"event": "attach_refused", "peer": pid})
            with contextlib.suppress(OSError):
                wire.send_frame(conn, {"ok": False, "error": str(exc)})
            return None
        conn.settimeout(None)  # an attached engine may stay idle as long as it likes
        directory = pool.directory
        wire.send_frame(conn, {"ok": True, "tenant": name, "arena_bytes": pool.arena_bytes,
                               "durable": pool.pool.durable_puts, "pid": os.getpid(),
                               "directory_bytes": directory.nbytes if directory is not None else 0},
                        fds=[pool.arena_fd] if directory is None else [pool.arena_fd, directory.fd])
        log.info("attached pid %d (uid %d) as tenant %s", pid, uid, name,
                 extra={"event": "attached", "peer": pid})
        return Session(pool, host.max_held, host.max_frame_bytes)

    def _serve(self, conn: socket.socket) -> None:
        host = self.config.host
        session: Session | None = None
        taken = 0

        def admit(size: int) -> None:
            nonlocal taken
            self._admit(size)
            taken = size

        try:
            session = self._attach(conn)
            reader = wire.FrameReader(conn)
            while session is not None and not self._stopped.is_set():
                meta, tail = reader.read(host.max_frame_bytes, admit=admit,
                                         body_timeout_s=host.request_timeout_s)
                answer = session.handle(meta, tail)
                del tail
                if taken:
                    self._release(taken)
                    taken = 0
                if answer is not None:
                    wire.send_frame(conn, answer[0], answer[1])
        except (OSError, ConnectionError):
            pass  # the engine went away (or broke the format, or stalled mid-message)
        finally:
            if taken:
                self._release(taken)
            if session is not None:
                session.close()
            with self._lock:
                self._connections = {k: c for k, c in self._connections.items()
                                     if c is not conn}
            conn.close()

    def stop(self) -> None:
        """Close the listener and every connection, then every tenant's pool. Idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        with self._lock:
            conns = list(self._connections.values())
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._close_pools()

    def _close_pools(self) -> None:
        """Every tenant's pool (their last events queued), then the publisher (it sends
        what is queued)."""
        self.tenants.close()
        if self.events is not None:
            self.events.close()
