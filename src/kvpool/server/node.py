"""The storage node behind ``kvpool serve``: an embedded KVPool (DRAM arena + SSD engine)
served over kvpool's binary protocol on asyncio/uvloop, registered in etcd when configured.

Lifecycle: ``run()`` binds, opens the pool, registers, prints one ``listening`` line and
serves until SIGTERM/SIGINT. Then it stops accepting, deregisters (clients stop routing to
it at once), lets in-flight requests finish (up to ``server.drain_timeout_s``), drains the
write-behind queue to SSD and closes the pool. A kill -9 loses only what was not yet on SSD;
the next start recovers the SSD log and serves it again (keys are content addresses).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvpool import __version__
from kvpool.config import Config
from kvpool.net.connection import tune_socket
from kvpool.pool import KVPool
from kvpool.server.auth import Authenticator
from kvpool.server.connection import Connection

log = logging.getLogger("kvpool.serve")


class StorageNode:
    """One node. Raises OSError if the port cannot be bound, and whatever KVPool raises for
    unusable tiers, before serving anything."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.auth = Authenticator(config.server.auth)
        self.executor = ThreadPoolExecutor(max(4, config.ssd.io_threads),
                                           thread_name_prefix="kvpool-node")
        self.net_executor = ThreadPoolExecutor(16, thread_name_prefix="kvpool-node-net")
        self._counters: dict[str, int] = {}  # event-loop thread only (stats() copies)
        self._inflight = 0
        self._connections: dict[asyncio.Task[None], Connection] = {}
        self.draining = False
        self.started = time.time()
        srv = config.server
        self.listener = socket.create_server((srv.host, srv.port), backlog=512,
                                             reuse_port=False)
        self.listener.setblocking(False)
        self.port: int = self.listener.getsockname()[1]
        self.host = srv.advertise_host or srv.host
        self.node_id = srv.node_id or f"{self.host}:{self.port}"
        try:
            self.pool = KVPool(config, remote=False)  # the node is the remote tier
        except BaseException:
            self.listener.close()
            raise

    # ------------------------------------------------------------------ bookkeeping
    def count(self, name: str, n: int = 1) -> None:
        self._counters[name] = self._counters.get(name, 0) + n

    @property
    def busy(self) -> bool:
        """More than one request in flight: large transfers then go to network threads."""
        return self._inflight > 1

    def begin_request(self) -> None:
        self._inflight += 1

    def end_request(self) -> None:
        self._inflight -= 1

    def stats(self) -> dict[str, Any]:
        server: dict[str, Any] = dict(self._counters)
        server.update(node_id=self.node_id, version=__version__,
                      connections=len(self._connections), inflight_requests=self._inflight,
                      uptime_s=round(time.time() - self.started, 1))
        return {"server": server, **self.pool.stats()}

    # ------------------------------------------------------------------ serving
    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(self.listener)
            if len(self._connections) >= self.config.server.max_connections or self.draining:
                self.count("connections_refused")
                sock.close()
                continue
            sock.setblocking(False)
            tune_socket(sock)
            self.count("connections_accepted")
            conn = Connection(self, sock)
            task = asyncio.create_task(self._serve_connection(conn))
            self._connections[task] = conn
            task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._connections.pop(task, None)

    async def _serve_connection(self, conn: Connection) -> None:
        try:
            await conn.serve()
        finally:
            conn.sock.close()

    async def _sweep_idle(self) -> None:
        """Once a second (or faster for short timeouts): cut off idle or stalled peers. One
        timer for the node instead of one per request."""
        loop = asyncio.get_running_loop()
        period = min(1.0, self.config.server.idle_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            now = loop.time()
            for conn in list(self._connections.values()):
                conn.close_if_idle(now)

    async def serve(self, ready: threading.Event | None = None) -> None:
        """Serve until ``stop()`` (or a signal when run by ``run``)."""
        self._stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            # Only the main thread may own signals (tests run nodes in threads too).
            with contextlib.suppress(RuntimeError, ValueError):
                loop.add_signal_handler(sig, self._stop.set)
        registration = self._register()
        accept = asyncio.create_task(self._accept_loop())
        sweeper = asyncio.create_task(self._sweep_idle())
        print(f"kvpool serve: node {self.node_id} listening on {self.host}:{self.port} "
              f"(pid {os.getpid()})", flush=True)
        if ready is not None:
            ready.set()
        try:
            await self._stop.wait()
        finally:
            sweeper.cancel()
            await self._shutdown(accept, registration)

    def stop(self) -> None:
        self._stop.set()

    def _register(self) -> Any:
        cluster = self.config.cluster
        if not cluster.etcd:
            return None
        from kvpool.cluster.membership import NodeInfo, NodeRegistration
        reg = NodeRegistration(cluster.etcd, cluster.name,
                               NodeInfo(self.node_id, self.host, self.port), cluster.lease_ttl_s)
        reg.start()
        return reg

    async def _shutdown(self, accept: asyncio.Task[None], registration: Any) -> None:
        self.draining = True
        accept.cancel()
        self.listener.close()
        if registration is not None:
            await asyncio.get_running_loop().run_in_executor(None, registration.close)
        deadline = time.monotonic() + self.config.server.drain_timeout_s
        while self._inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        loop = asyncio.get_running_loop()
        drained = await loop.run_in_executor(self.executor, self.pool.flush,
                                             max(0.0, deadline - time.monotonic()))
        if not drained:
            log.warning("write-behind queue not drained within drain_timeout_s")
        await loop.run_in_executor(self.executor, self.pool.close)
        self.executor.shutdown(wait=True)
        self.net_executor.shutdown(wait=True)
        print(f"kvpool serve: node {self.node_id} stopped", flush=True)


def run(config: Config) -> int:
    """Run a node in this process until SIGTERM/SIGINT. Returns the exit status."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    node = StorageNode(config)
    try:
        import uvloop
        uvloop.run(node.serve())
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(node.serve())
    return 0
