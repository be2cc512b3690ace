"""The storage node behind ``kvpool serve``: an embedded KVPool (DRAM arena + SSD engine)
served over kvpool's binary protocol, registered in etcd when configured. Each connection is
served by a thread of its own (connection.py); the asyncio/uvloop event loop only accepts
connections, runs the idle sweeper and the stop, and takes the signals.

Lifecycle: ``run()`` raises the soft fd limit to the hard one, binds, opens the pool,
registers, logs one ``listening`` line (on stdout, see kvpool.logs.STATUS_LOGGER) and serves.

- SIGTERM or SIGINT: a graceful stop within ``server.shutdown_timeout_s`` (one ``shutdown``
  line): stop accepting, answer new PUTs BUSY (a client counts a dropped save), deregister
  (clients stop routing to it at once), let in-flight requests finish (up to half of the
  budget; then their connections are closed), drain the write-behind queue to SSD with what
  is left of it, close the pool, one ``stopped`` line, exit 0. Either signal during start-up
  (SSD recovery, DRAM prefault) ends the start with one ``shutdown`` line, exit 0.
- SIGHUP: reload the config file and apply what can change live (reload.py; which keys is
  ``StorageNode._register_live``), one ``config_reloaded`` line naming what changed and what
  needs a restart. A file that no longer loads is one ``config_reload_failed`` line; the
  node keeps its settings.

A kill -9 loses only what was not yet on SSD; the next start recovers the SSD log and serves
it again (keys are content addresses). The metrics port also answers ``/healthz``,
``/readyz`` and ``/sd`` (health.py).

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
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from prometheus_client import ProcessCollector

from kvpool.cluster.membership import NodeInfo
from kvpool.config import Config
from kvpool.errors import ConfigError, KVPoolError
from kvpool.hostmem import check_node_memory
from kvpool.logs import STATUS_LOGGER, RateLimited, configure_logging
from kvpool.metrics.http import MetricsServer
from kvpool.metrics.recorder import LabeledLatency
from kvpool.metrics.server_collector import ServerCollector
from kvpool.net.connection import tune_socket
from kvpool.pool import KVPool
from kvpool.server.accept import AcceptBackoff, log_fd_limits, raise_fd_limit
from kvpool.server.auth import Authenticator
from kvpool.server.connection import Connection
from kvpool.server.health import events_page, health_pages
from kvpool.server.query import QueryService
from kvpool.server.reload import LiveSettings
from kvpool.server.repair import NodeRepair, RepairCollector, start_node_repair
from kvpool.server.retention import expire_due
from kvpool.server.store import NodeStore, scoped_chunk_key, scoped_chunk_keys
from kvpool.server.traffic import Traffic

log = logging.getLogger("kvpool.serve")
#: The ``listening`` and ``stopped`` lines: log records on stdout (kvpool.logs).
status = logging.getLogger(STATUS_LOGGER)

#: Server settings every part of the node reads at use: a reload applies them at once.
LIVE_SERVER_LIMITS = ("max_connections", "max_refusing", "idle_timeout_s", "auth_timeout_s",
                      "max_inflight_bytes", "max_frame_bytes", "max_keys", "max_item_bytes",
                      "max_namespaces_per_connection", "shutdown_timeout_s")
#: Read at use by whoever owns them; live without a hook.


class NodeStartError(KVPoolError):
    """The node cannot start for a reason the operator can fix; the message is one line
    naming the setting."""


class StopSignal(BaseException):
    """SIGTERM or SIGINT arrived while the node was starting (before its event loop took
    the signals): ``run`` ends the start cleanly. A BaseException, as KeyboardInterrupt, so
    that no ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.name = signal.Signals(signum).name


class StorageNode:
    """One node: the transport (this accept loop, the connections of connection.py) in
    front of a NodeStore (store.py) over an embedded KVPool. Raises OSError if the port
    cannot be bound or the media cannot be opened, and NodeStartError for tier geometry the
    media cannot hold, before serving anything. ``reload_config`` loads the config again
    for SIGHUP (None: SIGHUP is logged and ignored)."""

    def __init__(self, config: Config,
                 reload_config: Callable[[], Config] | None = None) -> None:
        self.config = config
        self._reload_config = reload_config
        srv = config.server
        self.tls = self._tls_context(config)  # None: plain TCP
        self.traffic = Traffic(LabeledLatency() if config.metrics.enabled else None)
        self._connections: dict[asyncio.Task[None], Connection] = {}
        self._refusing: dict[asyncio.Task[None], Connection] = {}
        self._say_refused = RateLimited()
        self._serving = False  # registered and accepting (readiness)
        self._stopping: str | None = None  # the signal (or "stop()") that stops it
        self._registration: Any = None
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
            self.pool = KVPool(config, remote=False, serve_metrics=False, publish_events=False)
        except (ValueError, KVPoolError) as exc:  # tier geometry the media cannot hold
            self.listener.close()
            raise NodeStartError(str(exc)) from None
        except BaseException:
            self.listener.close()
            raise
        self.events = self._start_events(config)  # KV events (docs/routing.md); None: off
        self.store = NodeStore(self.pool, srv, self.node_id)
        self._drain_watch: Any = None  # the etcd view this node learns its drain flag from
        self._identity_lock: Any = None  # held while registered: one process per identity
        self.exit_status = 0  # 2 once another node took this node id (registration lost)
        self.pool.metrics.register(ServerCollector(self.store.counters.snapshot,
                                                   self._metrics_state, self.traffic.latency))
        self._repair: NodeRepair | None = None  # re-replication and drain copying (repair.py)
        self.pool.metrics.register(RepairCollector(lambda: self._repair))
        ProcessCollector(registry=self.pool.metrics)
        self.live = LiveSettings()
        self._register_live()
        self.metrics_server: MetricsServer | None = None
        self.query: QueryService | None = None
        if srv.metrics_port is not None:
            try:
                pages = health_pages(self.readiness, self._members, config.cluster.name)
                pages.update(events_page(self.events))
                self.query = QueryService(self.pool, self.node_id, self._incarnation,
                                          self._members, self._expected, config.query.timeout_s,
                                          scoped_chunk_keys)
                self.metrics_server = MetricsServer(self.pool.metrics, srv.host,
                                                    srv.metrics_port, pages,
                                                    self.query.handlers())
            except BaseException:
                self.listener.close()
                self.pool.close()
                if self.events is not None:
                    self.events.close()
                raise

    def _start_events(self, config: Config) -> Any:
        """The node's KV event publisher (events.enabled unset or true), attached to its
        pool's tiers; None when off or pyzmq is missing. Raises NodeStartError naming the
        keys when a port cannot be bound."""
        from kvpool.events.attach import EventsCollector, bind_error, start_events
        ev = config.events
        if ev.enabled is False:
            self.pool.metrics.register(EventsCollector(None))
            return None
        try:
            return start_events(self.pool, ev.node_id or self.node_id,
                                ev.host or config.server.host, key_scope="namespace",
                                advertise=config.server.advertise_host)
        except Exception as exc:  # zmq.ZMQError: a port taken, an address not ours
            self.listener.close()
            self.pool.close()
            raise NodeStartError(bind_error(ev, exc)) from None

    def _incarnation(self) -> str | None:
        return self.events.incarnation if self.events is not None else None

    def _expected(self) -> frozenset[str]:
        """Every node that should be in the cluster (etcd's expected set; none without
        etcd)."""
        watch = self._drain_watch
        return watch.expected_nodes() if watch is not None else frozenset()

    @staticmethod
    def _tls_context(config: Config) -> ssl.SSLContext | None:
        """server.tls's context (None when off). Raises NodeStartError naming the key of a
        file that cannot be loaded."""
        if not config.server.tls.enabled:
            return None
        from kvpool.net.tls import TlsConfigError, server_context
        try:
            return server_context(config.server.tls)
        except TlsConfigError as exc:
            raise NodeStartError(str(exc)) from None

    def _connection(self, sock: socket.socket, refusal: str | None = None) -> Connection:
        """The connection object for an accepted socket: over TLS (server/tls.py) when
        server.tls is set, else plain."""
        if self.tls is None:
            return Connection(self.store, self.traffic, sock, refusal)
        from kvpool.server.tls import TlsConnection
        return TlsConnection(self.store, self.traffic, sock, self.tls, refusal)

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

    # ------------------------------------------------------------------ health
    def readiness(self) -> str | None:
        """None when the node should get traffic, else why not (``/readyz``)."""
        if self._stopping is not None:
            return "shutting down"
        if not self._serving:
            return "starting"
        if self.config.cluster.etcd and (self._registration is None
                                         or self._registration.lease_id is None):
            return "not registered in etcd (lease lost; registering again)"
        if not self._ssd_open():
            return "SSD tier closed"
        if self.store.drained:
            return "drained (kvpool admin drain)"
        return None

    def _ssd_open(self) -> bool:
        ssd = self.pool._stack.ssd  # the pool's tiers: the node owns its pool
        return ssd is None or not getattr(ssd.engine, "_closed", False)

    def _members(self) -> list[NodeInfo]:
        """The live nodes of the cluster as this node last saw them in etcd; without etcd,
        itself (``/sd``)."""
        if self._drain_watch is not None:
            members: list[NodeInfo] = self._drain_watch.live_nodes()
            return members
        port = self.metrics_server.port if self.metrics_server else None
        return [NodeInfo(self.node_id, self.host, self.port, port)]

    # ------------------------------------------------------------------ live settings
    def _register_live(self) -> None:
        """The settings a SIGHUP applies without a restart (the policy; reload.py is the
        mechanism). Everything else that changed is logged as needing a restart."""
        live = self.live
        def relog(_: object) -> None:
            configure_logging(self.config.log)

        live.register("log.level", relog)
        live.register("log.format", relog)
        for name in LIVE_SERVER_LIMITS:
            live.register(f"server.{name}")

        def repair_rate(rate: object) -> None:
            if self._repair is not None:
                self._repair.set_rate(int(rate))  # type: ignore[call-overload]

        # The rate changes live; turning repair on or off (0) needs a restart.
        live.register("cluster.repair_bytes_per_s", repair_rate,
                      guard=lambda old, new: bool(old) == bool(new))

        def new_tokens(_: object) -> None:
            srv = self.config.server
            self.store.auth = Authenticator(srv.auth, srv.admin_token)

        # Tokens change live for new AUTHs (open connections keep the identity they have);
        # turning auth on or off needs a restart.
        live.register("server.auth", new_tokens, guard=lambda old, new: bool(old) == bool(new))
        live.register("server.admin_token", new_tokens)

    def reload(self) -> None:
        """SIGHUP: load the config again and apply what can change live; one line. Never
        raises."""
        if self._reload_config is None:
            log.info("SIGHUP: no config file to reload", extra={"event": "config_reload_failed"})
            return
        try:
            new = self._reload_config()
        except ConfigError as exc:
            log.warning("config reload failed; keeping the running settings: %s", exc,
                        extra={"event": "config_reload_failed"})
            return
        result = self.live.apply(self.config, new)
        log.info("config reloaded: applied %s; needs a restart: %s",
                 ", ".join(result.applied) or "nothing",
                 ", ".join(result.restart_needed) or "nothing",
                 extra={"event": "config_reloaded", "node": self.node_id,
                        "applied": result.applied, "restart_needed": result.restart_needed})

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
        self._start(self._connection(sock), self._connections)

    def _refuse(self, sock: socket.socket, limit: int) -> None:
        """Over max_connections: answer the first request BUSY (within auth_timeout_s), then
        close. Past server.max_refusing such connections at once, close without an answer."""
        self.count("connections_refused")
        held = self._say_refused.due()
        if held is not None:
            log.warning("refusing connections over server.max_connections=%d%s", limit,
                        f" ({held} more since the last report)" if held else "",
                        extra={"event": "connections_refused", "held_back": held})
        if len(self._refusing) >= self.config.server.max_refusing:
            sock.close()
            return
        message = f"node {self.node_id} already serves server.max_connections={limit}"
        self._start(self._connection(sock, refusal=message), self._refusing)

    def _start(self, conn: Connection, table: dict[asyncio.Task[None], Connection]) -> None:
        task = asyncio.create_task(self._serve_connection(conn))
        table[task] = conn
        self.traffic.connections = len(self._connections)

        def done(t: asyncio.Task[None]) -> None:
            table.pop(t, None)
            self.traffic.connections = len(self._connections)

        task.add_done_callback(done)

    async def _serve_connection(self, conn: Connection) -> None:
        """Serve ``conn`` on a thread of its own and wait for it. Cancelled (the node stops):
        the socket is shut down, which ends the thread's blocking call, and the thread is
        waited for. The socket is closed once the thread is done."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def finished() -> None:
            if not done.done():
                done.set_result(None)

        def run() -> None:
            try:
                conn.serve()  # never raises
            finally:
                loop.call_soon_threadsafe(finished)

        threading.Thread(target=run, name=f"kvpool-conn {conn.peer}", daemon=True).start()
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            conn.shut()
            await done
            raise
        finally:
            conn.sock.close()

    async def _sweep_idle(self) -> None:
        """Once a second (or faster for short timeouts): cut off idle or stalled peers, and
        drop chunks whose retention TTL passed (server/retention.py). One timer for the node
        instead of one per request; the timeouts are read each round (a reload may change
        them)."""
        srv = self.config.server
        while True:
            await asyncio.sleep(min(1.0, srv.idle_timeout_s / 4, srv.auth_timeout_s / 4,
                                    srv.payload_stall_timeout_s / 4))
            now = time.monotonic()  # the connections' clock (their threads write it)
            for conn in [*self._connections.values(), *self._refusing.values()]:
                conn.close_if_idle(now)
            await expire_due(self.pool)

    async def serve(self, ready: threading.Event | None = None) -> None:
        """Serve until ``stop()`` (or a signal when run by ``run``)."""
        self._stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._loop = loop
        for sig in (signal.SIGTERM, signal.SIGINT):
            # Only the main thread may own signals (tests run nodes in threads too).
            with contextlib.suppress(RuntimeError, ValueError):
                loop.add_signal_handler(sig, self._stop_on, sig.name)
        with contextlib.suppress(RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGHUP, self.reload)
        try:  # etcd's HTTP on a thread: the loop (signals, the metrics' /readyz) keeps going
            registration = self._registration = await loop.run_in_executor(None, self._register)
        except BaseException:
            await self._release()
            raise
        await loop.run_in_executor(None, self._start_repair)  # loads its catalog from disk
        accept = asyncio.create_task(self._accept_loop())
        sweeper = asyncio.create_task(self._sweep_idle())
        self._serving = True
        mport = self.metrics_server.port if self.metrics_server else None
        metrics = f", metrics on port {mport}" if mport is not None else ""
        status.info("kvpool serve: node %s listening on %s:%d (pid %d)%s", self.node_id,
                    self.host, self.port, os.getpid(), metrics,
                    extra={"event": "listening", "node": self.node_id, "host": self.host,
                           "port": self.port, "pid": os.getpid(), "metrics_port": mport})
        log_fd_limits(log, self.config.server.max_connections)
        if ready is not None:
            ready.set()
        try:
            await self._stop.wait()
        finally:
            sweeper.cancel()
            await self._shutdown(accept, registration)

    def _stop_on(self, why: str) -> None:
        if self._stopping is None:
            self._stopping = why
        self._stop.set()

    def stop(self) -> None:
        self._stop_on("stop()")

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

    def _start_repair(self) -> None:
        """Start the repair thread (with etcd; server/repair.py) and let PUTs note their keys
        in its catalog. A failure to start it is logged: the node serves without it."""
        try:
            self._repair = start_node_repair(self.config, self.node_id, self.pool,
                                             self._drain_watch, scoped_chunk_key)
        except Exception:
            log.exception("repair not started")
        if self._repair is not None:
            self.store.catalog = self._repair.catalog

    async def _shutdown(self, accept: asyncio.Task[None], registration: Any) -> None:
        """The graceful stop (module docstring), bounded by server.shutdown_timeout_s."""
        started = time.monotonic()
        budget = self.config.server.shutdown_timeout_s
        deadline = started + budget
        if self._stopping is None:
            self._stopping = "stop()"
        log.info("node %s stopping (%s): refusing new PUTs, finishing %d in-flight "
                 "requests, deregistering, flushing the write-behind queue (at most %.0f s)",
                 self.node_id, self._stopping, self.traffic.inflight, budget,
                 extra={"event": "shutdown", "node": self.node_id, "cause": self._stopping,
                        "inflight": self.traffic.inflight, "timeout_s": budget})
        self.traffic.draining = True
        accept.cancel()
        self.listener.close()
        loop = asyncio.get_running_loop()
        if registration is not None:
            await loop.run_in_executor(None, registration.close)
        if self._repair is not None:
            await loop.run_in_executor(None, self._repair.close)
        while self.traffic.inflight and time.monotonic() < started + budget / 2:
            await asyncio.sleep(0.01)
        if self.traffic.inflight:
            log.warning("node %s: %d requests still in flight after %.1f s; closing their "
                        "connections", self.node_id, self.traffic.inflight,
                        time.monotonic() - started,
                        extra={"event": "shutdown_cut_requests", "node": self.node_id,
                               "inflight": self.traffic.inflight})
        tasks = [*self._connections, *self._refusing]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        flushed = await loop.run_in_executor(None, self.pool.flush,
                                             max(0.0, deadline - time.monotonic()))
        if not flushed:
            log.warning("node %s: write-behind queue not drained within "
                        "server.shutdown_timeout_s=%.0f s; what is left is lost",
                        self.node_id, budget,
                        extra={"event": "shutdown_flush_incomplete", "node": self.node_id})
        await self._release()
        status.info("kvpool serve: node %s stopped", self.node_id,
                    extra={"event": "stopped", "node": self.node_id, "flushed": flushed,
                           "seconds": round(time.monotonic() - started, 3)})

    async def _release(self) -> None:
        """Close the listener, the metrics endpoint, the drain watch and the pool."""
        self.listener.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        if self._drain_watch is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._drain_watch.close)
        if self._identity_lock is not None:
            self._identity_lock.release()
        await asyncio.get_running_loop().run_in_executor(None, self.pool.close)
        if self.query is not None:
            self.query.close()
        if self.events is not None:
            self.events.close()


@contextlib.contextmanager
def startup_signals() -> Iterator[None]:
    """While the node starts (SSD recovery, DRAM prefault, binding): SIGTERM and SIGINT
    raise StopSignal in the main thread, SIGHUP is logged and ignored (there is nothing to
    reload yet). The event loop's handlers replace these once it serves."""
    def stop(signum: int, frame: FrameType | None) -> None:
        raise StopSignal(signum)

    def hangup(signum: int, frame: FrameType | None) -> None:
        log.info("SIGHUP during start-up ignored; send it again once the node is listening",
                 extra={"event": "config_reload_ignored"})

    previous = {sig: signal.signal(sig, handler) for sig, handler in
                ((signal.SIGTERM, stop), (signal.SIGINT, stop), (signal.SIGHUP, hangup))}
    try:
        yield
    except BaseException:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        raise


def run(config: Config, reload_config: Callable[[], Config] | None = None) -> int:
    """Run a node in this process until SIGTERM/SIGINT; SIGHUP reloads with
    ``reload_config``. Returns the exit status: 0 after a graceful stop, also when a stop
    signal ends the start (one ``shutdown`` line). Raises NodeStartError (a fixable
    setting), OSError (e.g. the port is taken)."""
    configure_logging(config.log)
    try:
        with startup_signals():
            raise_fd_limit(log)
            node = StorageNode(config, reload_config)
            freeze_startup_heap()
        try:
            import uvloop
        except ImportError:  # the [server] extra was not installed
            log.warning("kvpool serve: uvloop is not installed (pip install 'kvpool[server]'); "
                        "serving on asyncio's default event loop", extra={"event": "no_uvloop"})
            asyncio.run(node.serve())
        else:
            uvloop.run(node.serve())
    except StopSignal as stop:  # before the loop took the signals: nothing served yet
        log.info("kvpool serve: %s during start-up; stopped before serving anything", stop.name,
                 extra={"event": "shutdown", "cause": stop.name, "phase": "start-up"})
        return 0
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
