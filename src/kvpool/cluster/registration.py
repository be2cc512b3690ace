"""Keeping one storage node listed in etcd: a lease, its key, and a keepalive thread.

The key and its value are described in :mod:`kvpool.cluster.membership`. Failure policy: only
:meth:`NodeRegistration.start` raises (:class:`~kvpool.cluster.etcd.EtcdError`: a node that
cannot register at start is loud); afterwards etcd outages are logged and retried, a lost
lease is granted again, and :meth:`NodeRegistration.close` never raises.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Sequence

from kvpool.cluster.etcd import GRPC_NOT_FOUND, EtcdClient, EtcdError
from kvpool.cluster.membership import NodeInfo, registration_key

__all__ = ["NodeRegistration"]

log = logging.getLogger(__name__)


class NodeRegistration:
    """Keeps ``node`` registered in ``cluster`` while this process is alive.

    :meth:`start` grants a lease of ``ttl_s`` (rounded up to whole seconds; etcd may raise it
    to its minimum), puts the node's key with it, and starts a daemon thread that refreshes the
    lease every ``ttl_s / 3``. If the lease is lost (it expired while etcd was unreachable, or
    etcd came back without its data) the thread grants a new one and puts the key again. While
    etcd is unreachable it logs one warning and retries every second or so; it never raises.
    If the process dies, the key disappears after the TTL.
    """

    def __init__(self, endpoints: Sequence[str], cluster: str, node: NodeInfo,
                 ttl_s: float = 10.0, timeout_s: float = 2.0) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        self.node = node
        self.cluster = cluster
        self.key = registration_key(cluster, node.node_id)
        self.ttl_s = float(ttl_s)
        self._client = EtcdClient(endpoints, timeout_s)
        self._lock = threading.Lock()
        self._lease: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def lease_id(self) -> int | None:
        """The current lease, None before start(), after close() or while re-registering."""
        with self._lock:
            return self._lease

    def start(self) -> NodeRegistration:
        """Register and start the keepalive thread; returns self.

        Raises EtcdError if etcd cannot be reached or refuses the lease or the put (nothing is
        left registered then), RuntimeError if already started or closed.
        """
        with self._lock:
            if self._closed or self._thread is not None:
                raise RuntimeError(f"registration of {self.node.node_id!r} already "
                                   f"{'closed' if self._closed else 'started'}")
            self._thread = threading.Thread(target=self._run,
                                            name=f"kvpool-registration-{self.node.node_id}",
                                            daemon=True)
        try:
            self._register()
        except BaseException:
            with self._lock:
                self._thread = None
            raise
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the keepalive thread and revoke the lease, so the node disappears at once.

        Idempotent. Never raises: if etcd cannot be reached the failure is logged and the key
        expires after the TTL instead.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is None:
            return
        try:
            self._client.lease_revoke(lease)
        except EtcdError as exc:
            log.warning("kvpool registration %s: could not revoke lease; the node stays listed "
                        "until its TTL (%.0f s) runs out: %s", self.key, self.ttl_s, exc,
                        extra={"event": "deregister_failed", "key": self.key})

    def __enter__(self) -> NodeRegistration:
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _register(self) -> None:
        lease, _ = self._client.lease_grant(max(1, math.ceil(self.ttl_s)))
        try:
            self._client.put(self.key, self.node.to_json(), lease=lease)
        except EtcdError:
            with contextlib.suppress(EtcdError):  # if not, it expires on its own
                self._client.lease_revoke(lease)
            raise
        with self._lock:
            self._lease = lease

    def _keepalive(self, lease: int) -> int:
        try:
            return self._client.lease_keepalive(lease)
        except EtcdError as exc:
            if exc.code == GRPC_NOT_FOUND:
                return 0
            raise

    def _run(self) -> None:
        interval = self.ttl_s / 3
        retry = min(interval, 1.0)
        warned = False
        wait = interval
        while not self._stop.wait(wait):
            try:
                lease = self.lease_id
                if lease is None:
                    self._register()
                    log.warning("kvpool registration %s: registered again", self.key,
                                extra={"event": "registered_again", "key": self.key})
                elif self._keepalive(lease) <= 0:
                    log.warning("kvpool registration %s: lease %x was lost, registering again",
                                self.key, lease, extra={"event": "lease_lost", "key": self.key})
                    with self._lock:
                        self._lease = None
                    self._register()
                if warned:
                    log.info("kvpool registration %s: etcd reachable again", self.key,
                             extra={"event": "etcd_reachable", "key": self.key})
                    warned = False
                wait = interval
            except EtcdError as exc:
                if not warned:
                    log.warning("kvpool registration %s: etcd unreachable, retrying: %s",
                                self.key, exc, extra={"event": "etcd_unreachable",
                                                      "key": self.key})
                    warned = True
                else:
                    log.debug("kvpool registration %s: still unreachable: %s", self.key, exc)
                wait = retry
            except Exception:
                log.exception("kvpool registration %s: keepalive thread error", self.key)
                wait = retry
