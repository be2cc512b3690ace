"""The host pool (``kvpool host``): the tenants' pools behind a Unix socket that the host's
engine processes attach to.

One thread per attached connection (blocking reads; an engine's requests are served in the
order it sent them), one accept thread. An attach: the peer's uid (SO_PEERCRED) must be
allowed (tenants.peer_allowed), then its HELLO's token must name its tenant
(tenants.tenant_for); only then is the tenant's arena sent, as a file descriptor. A refused
attach is answered ``ok: false`` with the reason and closed.

Failure contract: a connection that breaks the format, goes silent mid-frame, or whose peer
dies (SIGKILL included) is closed and its session released (pins, reservations); nothing
else notices. ``stop`` closes the listener, every connection and every tenant's pool (the
write-behind queues drain to SSD); the socket file is removed. A host pool killed -9 leaves
its socket file behind: the next start finds nobody answering on it and replaces it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import struct
import threading
from pathlib import Path

from kvpool.config import Config
from kvpool.errors import KVPoolError
from kvpool.host import wire
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


class HostServer:
    """Listens on ``config.host.socket``. Raises HostStartError (socket taken, no DRAM),
    OSError (cannot bind)."""

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
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.path))
        # Anyone may connect; SO_PEERCRED and the token decide who attaches.
        os.chmod(self.path, 0o666)
        self.listener.listen(128)
        self._connections: dict[int, socket.socket] = {}
        self._lock = threading.Lock()
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
        while not self._stopped.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                if self._stopped.is_set():
                    return
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kvpool-host-conn",
                             daemon=True).start()

    def _attach(self, conn: socket.socket) -> Session | None:
        """The HELLO exchange; None (answered and to be closed) when refused."""
        host = self.config.host
        conn.settimeout(host.request_timeout_s)
        pid, uid, _ = peer_credentials(conn)
        try:
            meta, _, _ = wire.recv_frame(conn, 0)
            if not peer_allowed(self.config, uid):
                raise AttachRefused(f"uid {uid} may not attach (host.allowed_uids)")
            if meta.get("op") != wire.HELLO:
                raise AttachRefused("the first request must be hello")
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
        wire.send_frame(conn, {"ok": True, "tenant": name, "arena_bytes": pool.arena_bytes,
                               "durable": pool.pool.durable_puts, "pid": os.getpid()},
                        fds=[pool.arena_fd])
        log.info("attached pid %d (uid %d) as tenant %s", pid, uid, name,
                 extra={"event": "attached", "peer": pid})
        return Session(pool, host.max_held, host.max_frame_bytes)

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections[conn.fileno()] = conn
        session: Session | None = None
        try:
            session = self._attach(conn)
            while session is not None and not self._stopped.is_set():
                meta, tail, _ = wire.recv_frame(conn, self.config.host.max_frame_bytes)
                answer = session.handle(meta, tail)
                if answer is not None:
                    wire.send_frame(conn, answer[0], answer[1])
        except (OSError, ConnectionError):
            pass  # the engine went away (or broke the format): its session dies with it
        finally:
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
        self.tenants.close()
