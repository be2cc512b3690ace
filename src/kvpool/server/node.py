"""The storage node behind ``kvpool serve``: an embedded KVPool (DRAM arena + SSD engine)
served over kvpool's binary protocol on asyncio/uvloop, registered in etcd when configured.

Lifecycle: ``run()`` raises the soft fd limit to the hard one, binds, opens the pool,
registers, prints one ``listening`` line and serves until SIGTERM/SIGINT. Then it stops
accepting, deregisters (clients stop routing to it at once), lets in-flight requests finish
(up to ``server.drain_timeout_s``), drains the write-behind queue to SSD and closes the pool.
A kill -9 loses only what was not yet on SSD; the next start recovers the SSD log and serves
it again (keys are content addresses).

At start the node warns (one WARNING line, event ``memory_reserve``) when dram.capacity plus
its overhead exceed 80% of the memory available (``kvpool.hostmem``). Start-up failures a
user can fix (tier geometry the media cannot hold, an etcd that cannot be reached to
register, a server.node_id another node holds: kvpool.cluster.registration) raise
NodeStartError with one line naming the setting; ``kvpool serve`` prints it and exits 2. A
node that loses its node id to another node later (its lease lost meanwhile) stops, exit 2.
A node never dies of a failed accept (see ``accept.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvpool.config import Config
from kvpool.errors import KVPoolError
from kvpool.hostmem import check_node_memory
from kvpool.logs import RateLimited, configure_logging
from kvpool.metrics.http import MetricsServer
from kvpool.metrics.recorder import LabeledLatency
from kvpool.metrics.server_collector import ServerCollector
from kvpool.net.connection import tune_socket
from kvpool.pool import KVPool
from kvpool.server.accept import AcceptBackoff, log_fd_limits, raise_fd_limit
from kvpool.server.connection import Connection
from kvpool.server.store import NodeStore
from kvpool.server.traffic import Traffic

log = logging.getLogger("kvpool.serve")


class NodeStartError(KVPoolError):
    """The node cannot start for a reason the operator can fix; the message is one line
    naming the setting."""


class StorageNode:
    """One node: the transport (this accept loop, the connections of connection.py) in
    front of a NodeStore (store.py) over an embedded KVPool. Raises OSError if the port
    cannot be bound or the media cannot be opened, and NodeStartError for tier geometry the
    media cannot hold, before serving anything."""

    def __init__(self, config: Config) -> None:
        self.config = config
        srv = config.server
        self.executor = ThreadPoolExecutor(srv.worker_threads or max(4, config.ssd.io_threads),
                                           thread_name_prefix="kvpool-node")
        self.traffic = Traffic(srv.net_threads,
                               LabeledLatency() if config.metrics.enabled else None,
                               srv.lane_connections)
        self._connections = self.traffic.served
        self._refusing: dict[asyncio.Task[None], Connection] = {}
        self._say_refused = RateLimited()
        self.listener = socket.create_server((srv.host, srv.port), backlog=512,
                                             reuse_port=False)
        self.listener.setblocking(False)
        self.port: int = self.listener.getsockname()[1]
        self.host = srv.advertise_host or srv.host
        self.node_id = srv.node_id or f"{self.host}:{self.port}"
        # Before the arena is taken (with dram.prefault: start it would lower MemAvailable).
        check_node_memory(log, config.dram.capacity, config.pool.write_behind_bytes)
        try:
            # the node is the remote tier; it serves the pool's metrics with its own
            self.pool = KVPool(config, remote=False, serve_metrics=False)
        except (ValueError, KVPoolError) as exc:  # tier geometry the media cannot hold
            self.listener.close()
            raise NodeStartError(str(exc)) from None
        except BaseException:
            self.listener.close()
            raise
        self.store = NodeStore(self.pool, srv, self.executor, self.node_id)
        self._drain_watch: Any = None  # the etcd view this node learns its drain flag from
        self._identity_lock: Any = None  # held while registered: one process per identity
        self.exit_status = 0  # 2 once another node took this node id (registration lost)
        self.pool.metrics.register(ServerCollector(self.store.counters.snapshot,
                                                   self._metrics_state, self.traffic.latency))
        self.metrics_server: MetricsServer | None = None
        if srv.metrics_port is not None:
            try:
                self.metrics_server = MetricsServer(self.pool.metrics, srv.host,
                                                    srv.metrics_port)
            except BaseException:
                self.listener.close()
                self.pool.close()
                raise

    def _metrics_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"connections": len(self._connections),
                                 "draining": self.store.drained}
        # kvpool_cluster_nodes{state}: the cluster as this node's etcd watch sees it; without
        # etcd the node knows of no other node: itself, live
        from kvpool.cluster.states import node_states, state_counts
        watch = self._drain_watch
        state["cluster_nodes"] = state_counts(node_states(
            (n.node_id for n in watch.live_nodes()), watch.expected_nodes(),
            watch.drained_nodes()) if watch is not None else {self.node_id: "live"})
        return state

    def count(self, name: str, n: int = 1) -> None:
        self.store.counters.add(name, n)

    # ------------------------------------------------------------------ serving
    async def _accept_loop(self) -> None:
        """Accept until cancelled. A failed accept (out of fds, an aborted connection) is
        counted, logged rate-limited and retried after a back-off; it never ends the loop."""
        loop = asyncio.get_running_loop()
        backoff = AcceptBackoff(log)
        while True:
            try:
                sock, _ = await loop.sock_accept(self.listener)
            except OSError as exc:
                self.count("accept_errors")
                delay = backoff.failed(exc, len(self._connections) + len(self._refusing))
                if delay:
                    await asyncio.sleep(delay)
                continue
            backoff.succeeded()
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        try:
            sock.setblocking(False)
            tune_socket(sock)
        except OSError:  # reset before we got to it
            sock.close()
            return
        if self.traffic.draining:
            sock.close()
            return
        limit = self.config.server.max_connections
        if len(self._connections) >= limit:
            self._refuse(sock, limit)
            return
        self.count("connections_accepted")
        self._start(Connection(self.store, self.traffic, sock), self._connections)

    def _refuse(self, sock: socket.socket, limit: int) -> None:
        """Over max_connections: answer the first request BUSY (within auth_timeout_s), then
        close. Past server.max_refusing such connections at once, close without an answer."""
        self.count("connections_refused")
        held = self._say_refused.due()
        if held is not None:
            log.warning("refusing connections over server.max_connections=%d%s", limit,
                        f" ({held} more since the last report)" if held else "")
        if len(self._refusing) >= self.config.server.max_refusing:
            sock.close()
            return
        message = f"node {self.node_id} already serves server.max_connections={limit}"
        self._start(Connection(self.store, self.traffic, sock, refusal=message),
                    self._refusing)

    def _start(self, conn: Connection, table: dict[asyncio.Task[None], Connection]) -> None:
        task = asyncio.create_task(self._serve_connection(conn))
        table[task] = conn
        task.add_done_callback(lambda t: table.pop(t, None))

    async def _serve_connection(self, conn: Connection) -> None:
        try:
            await conn.serve()
        finally:
            conn.sock.close()

    async def _sweep_idle(self) -> None:
        """Once a second (or faster for short timeouts): cut off idle or stalled peers. One
        timer for the node instead of one per request."""
        srv = self.config.server
        period = min(1.0, srv.idle_timeout_s / 4, srv.auth_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()  # the connections' clock (lane threads write it too)
            for conn in [*self._connections.values(), *self._refusing.values()]:
                conn.close_if_idle(now)

    async def serve(self, ready: threading.Event | None = None) -> None:
        """Serve until ``stop()`` (or a signal when run by ``run``)."""
        self._stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._loop = loop
        for sig in (signal.SIGTERM, signal.SIGINT):
            # Only the main thread may own signals (tests run nodes in threads too).
            with contextlib.suppress(RuntimeError, ValueError):
                loop.add_signal_handler(sig, self._stop.set)
        try:
            registration = self._register()
        except BaseException:
            await self._release()
            raise
        accept = asyncio.create_task(self._accept_loop())
        sweeper = asyncio.create_task(self._sweep_idle())
        metrics = f", metrics on port {self.metrics_server.port}" if self.metrics_server else ""
        print(f"kvpool serve: node {self.node_id} listening on {self.host}:{self.port} "
              f"(pid {os.getpid()}){metrics}", flush=True)
        log_fd_limits(log, self.config.server.max_connections)
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
        """Register in etcd (if configured) and follow this node's drain flag there (``kvpool
        admin drain``: the store's ``drained``). Raises NodeStartError when etcd cannot be
        reached or refuses: a node nobody can find must not look as if it were serving."""
        cluster = self.config.cluster
        if not cluster.etcd:
            return None
        from kvpool.cluster.etcd import EtcdError
        from kvpool.cluster.etcd_membership import EtcdMembership
        from kvpool.cluster.identity import hold_identity, new_incarnation
        from kvpool.cluster.membership import NodeInfo
        from kvpool.cluster.registration import NodeIdTakenError, NodeRegistration
        try:
            identity, self._identity_lock = hold_identity(self.config.cache_dir)
        except (OSError, ValueError) as exc:
            raise NodeStartError(f"cache_dir={self.config.cache_dir}: cannot keep the node "
                                 f"identity: {exc}") from None
        try:
            metrics_port = self.metrics_server.port if self.metrics_server else None
            reg = NodeRegistration(cluster.etcd, cluster.name,
                                   NodeInfo(self.node_id, self.host, self.port, metrics_port,
                                            incarnation=new_incarnation(), identity=identity),
                                   cluster.lease_ttl_s, on_taken=self._node_id_taken)
            reg.start()  # first: a node id that is taken is refused before anything is logged
            try:
                watch = EtcdMembership(cluster.etcd, cluster.name, grace_s=cluster.grace_s)
            except BaseException:
                reg.close()
                raise
            self._drain_watch = watch
            self.store.drain_flag = lambda: self.node_id in watch.drained_nodes()
        except NodeIdTakenError as exc:
            raise NodeStartError(str(exc)) from None
        except (EtcdError, ValueError) as exc:
            raise NodeStartError(f"cluster.etcd={','.join(cluster.etcd)}: cannot register node "
                                 f"{self.node_id}: {exc}") from None
        return reg

    def _node_id_taken(self, exc: Exception) -> None:
        """From the registration thread: another node holds this node id now (this one lost
        its lease meanwhile). Stop serving; ``kvpool serve`` exits 2."""
        self.exit_status = 2
        self._loop.call_soon_threadsafe(self._stop.set)

    async def _shutdown(self, accept: asyncio.Task[None], registration: Any) -> None:
        self.traffic.draining = True
        accept.cancel()
        self.listener.close()
        if registration is not None:
            await asyncio.get_running_loop().run_in_executor(None, registration.close)
        deadline = time.monotonic() + self.config.server.drain_timeout_s
        while self.traffic.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        tasks = [*self._connections, *self._refusing]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        loop = asyncio.get_running_loop()
        drained = await loop.run_in_executor(self.executor, self.pool.flush,
                                             max(0.0, deadline - time.monotonic()))
        if not drained:
            log.warning("write-behind queue not drained within drain_timeout_s")
        await self._release()
        print(f"kvpool serve: node {self.node_id} stopped", flush=True)

    async def _release(self) -> None:
        """Close the listener, the metrics endpoint, the drain watch, the pool and the worker
        threads."""
        self.listener.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        if self._drain_watch is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._drain_watch.close)
        if self._identity_lock is not None:
            self._identity_lock.release()
        await asyncio.get_running_loop().run_in_executor(self.executor, self.pool.close)
        self.executor.shutdown(wait=True)
        self.traffic.shutdown()


def run(config: Config) -> int:
    """Run a node in this process until SIGTERM/SIGINT. Returns the exit status. Raises
    NodeStartError (a fixable setting), OSError (e.g. the port is taken)."""
    configure_logging(config.log)
    raise_fd_limit(log)
    node = StorageNode(config)
    freeze_startup_heap()
    try:
        import uvloop
        uvloop.run(node.serve())
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(node.serve())
    return node.exit_status


def freeze_startup_heap() -> int:
    """Move every object alive now (modules, classes, the config, the tiers and what SSD
    recovery indexed) out of reach of the cyclic garbage collector: a full collection then
    scans only what the node allocated since. On the 2-core VM a node's startup heap is
    ~45,000 tracked objects, and every full collection that scans it pauses all requests for
    10-30 ms. Frozen objects are still freed by reference counting; only garbage cycles among
    them would outlive the process. Returns how many objects are frozen; never raises."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
