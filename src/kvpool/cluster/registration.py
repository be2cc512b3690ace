"""Keeping one storage node listed in etcd: a lease, its key, and a keepalive thread.

The key and its value are described in :mod:`kvpool.cluster.membership`. A node claims its key
with a transaction that succeeds only if the key is absent or names the node's own identity
(its cache_dir's, :mod:`kvpool.cluster.identity`): a second node started with the same
``server.node_id`` is refused (:class:`NodeIdTakenError`) and never overwrites the first, and
a node that stops removes the key only while it is still its own.

Failure policy: only :meth:`NodeRegistration.start` raises (:class:`~kvpool.cluster.etcd.EtcdError`,
:class:`NodeIdTakenError`: a node that cannot register at start is loud); afterwards etcd
outages are logged and retried, a lost lease is granted again and the key claimed again under
the same rule. If another identity holds the key by then, the thread logs one ERROR (event
``node_id_taken``), stops, and calls ``on_taken``: the node must stop serving.
:meth:`NodeRegistration.close` never raises.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from kvpool.cluster.etcd import (
    GRPC_NOT_FOUND,
    EtcdClient,
    EtcdError,
    compare,
    op_delete,
    op_get,
    op_put,
)
from kvpool.cluster.identity import new_identity, new_incarnation
from kvpool.cluster.membership import NodeInfo, expected_key, registration_key
from kvpool.errors import KVPoolError

__all__ = ["NodeIdTakenError", "NodeRegistration"]

log = logging.getLogger(__name__)

_CLAIM_ATTEMPTS = 5  # compare-and-swap retries when the key changes between read and write


class NodeIdTakenError(KVPoolError):
    """The node's key is held by another node (another cache_dir identity). ``holder`` is
    that node's record (None if the key holds something that is not a node record)."""

    def __init__(self, message: str, holder: NodeInfo | None) -> None:
        super().__init__(message)
        self.holder = holder


class NodeRegistration:
    """Keeps ``node`` registered in ``cluster`` while this process is alive.

    ``node.identity`` names the node's cache_dir (a random one when None: nothing then is
    recognised as this node's earlier run); ``node.incarnation`` is set to a fresh id when
    None. :meth:`start` grants a lease of ``ttl_s`` (rounded up to whole seconds; etcd may
    raise it to its minimum), claims the node's key with it (see the module docstring) and
    puts the node in the expected set, and starts a daemon thread that refreshes the lease
    every ``ttl_s / 3``. If the lease is lost (it expired while etcd was unreachable or
    paused, or etcd came back without its data) the thread grants a new one and claims the
    key again at once. While etcd is unreachable it logs one warning and retries every
    second or so. If the process dies, the key disappears after the TTL.
    """

    def __init__(self, endpoints: Sequence[str], cluster: str, node: NodeInfo,
                 ttl_s: float = 10.0, timeout_s: float = 2.0,
                 on_taken: Callable[[NodeIdTakenError], None] | None = None) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        self.node = replace(node, identity=node.identity or new_identity(),
                            incarnation=node.incarnation or new_incarnation(), stopping=False)
        self.cluster = cluster
        self.key = registration_key(cluster, node.node_id)
        self.expected_key = expected_key(cluster, node.node_id)
        self.ttl_s = float(ttl_s)
        self._client = EtcdClient(endpoints, timeout_s)
        self._on_taken = on_taken
        self._lock = threading.Lock()
        self._lease: int | None = None
        self._revision = 0  # mod_revision of our key as we last wrote it
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

        Raises NodeIdTakenError if another node holds the key, EtcdError if etcd cannot be
        reached or refuses the lease or the transaction (nothing is left registered then),
        RuntimeError if already started or closed.
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
        """Stop the keepalive thread and leave: mark the record ``stopping`` (clients drop
        the node at once), delete the key, revoke the lease. Each step only while the key is
        still the one this registration wrote, so a node that lost its key to another never
        removes that one's.

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
            revision = self._revision
        if lease is None:
            return
        try:
            marked = self._client.txn(
                [compare(self.key, "MOD", revision)],
                [op_put(self.key, replace(self.node, stopping=True).to_json(), lease)])
            if marked.succeeded:
                self._client.txn([compare(self.key, "MOD", marked.revision)],
                                 [op_delete(self.key)])
            self._client.lease_revoke(lease)
        except EtcdError as exc:
            log.warning("kvpool registration %s: could not deregister; the node stays listed "
                        "until its TTL (%.0f s) runs out: %s", self.key, self.ttl_s, exc,
                        extra={"event": "deregister_failed", "node": self.node.node_id})

    def __enter__(self) -> NodeRegistration:
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _register(self) -> None:
        lease, _ = self._client.lease_grant(max(1, math.ceil(self.ttl_s)))
        try:
            revision = self._claim(lease)
        except (EtcdError, NodeIdTakenError):
            with contextlib.suppress(EtcdError):  # if not, it expires on its own
                self._client.lease_revoke(lease)
            raise
        with self._lock:
            self._lease = lease
            self._revision = revision

    def _claim(self, lease: int) -> int:
        """Put our record with ``lease`` if the key is absent or names our identity, and our
        entry in the expected set; the revision written. Raises NodeIdTakenError."""
        expected = json.dumps({"address": self.node.address(), "identity": self.node.identity,
                               "since": time.time()}, sort_keys=True).encode("utf-8")
        success = [op_put(self.key, self.node.to_json(), lease),
                   op_put(self.expected_key, expected)]
        condition = compare(self.key, "CREATE", 0)
        for _ in range(_CLAIM_ATTEMPTS):
            result = self._client.txn([condition], success, [op_get(self.key)])
            if result.succeeded:
                return result.revision
            held = result.ranges[0] if result.ranges else []
            if not held:  # deleted since: claim it as absent
                condition = compare(self.key, "CREATE", 0)
                continue
            try:
                holder: NodeInfo | None = NodeInfo.from_json(held[0].value)
            except ValueError:
                holder = None
            if holder is None or holder.identity != self.node.identity:
                raise NodeIdTakenError(self._taken_message(holder), holder)
            # our own earlier run (e.g. killed before its lease ran out): take it over
            condition = compare(self.key, "MOD", held[0].mod_revision)
        raise EtcdError(f"etcd: {self.key} kept changing while this node claimed it "
                        f"({_CLAIM_ATTEMPTS} attempts)")

    def _taken_message(self, holder: NodeInfo | None) -> str:
        node_id = self.node.node_id
        if holder is None:
            return (f"node id {node_id} is taken: {self.key} in etcd holds something that is "
                    "not a node record")
        return (f"node id {node_id} is taken by the node at {holder.address()} (another "
                f"cache_dir, identity {str(holder.identity)[:8]}); give this node its own "
                "server.node_id, or stop that one")

    def _keepalive(self, lease: int) -> int:
        try:
            return self._client.lease_keepalive(lease)
        except EtcdError as exc:
            if exc.code == GRPC_NOT_FOUND:
                return 0
            raise

    def _taken(self, exc: NodeIdTakenError) -> None:
        log.error("kvpool registration %s: lost the registration and cannot take it back: %s; "
                  "this node stops", self.key, exc,
                  extra={"event": "node_id_taken", "node": self.node.node_id,
                         "holder": exc.holder.address() if exc.holder else None})
        self._stop.set()
        if self._on_taken is not None:
            try:
                self._on_taken(exc)
            except Exception:
                log.exception("kvpool registration %s: on_taken callback failed", self.key)

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
                                extra={"event": "registered_again", "node": self.node.node_id})
                elif self._keepalive(lease) <= 0:
                    log.warning("kvpool registration %s: lease %x was lost, registering again",
                                self.key, lease,
                                extra={"event": "lease_lost", "node": self.node.node_id})
                    with self._lock:
                        self._lease = None
                    self._register()
                if warned:
                    log.info("kvpool registration %s: etcd reachable again", self.key,
                             extra={"event": "etcd_reachable", "node": self.node.node_id})
                    warned = False
                wait = interval
            except NodeIdTakenError as exc:
                self._taken(exc)
                return
            except EtcdError as exc:
                if not warned:
                    log.warning("kvpool registration %s: etcd unreachable, retrying: %s",
                                self.key, exc,
                                extra={"event": "etcd_unreachable", "node": self.node.node_id})
                    warned = True
                else:
                    log.debug("kvpool registration %s: still unreachable: %s", self.key, exc)
                wait = retry
            except Exception:
                log.exception("kvpool registration %s: keepalive thread error", self.key)
                wait = retry
