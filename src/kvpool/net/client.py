"""ClusterClient: the shared pool of storage nodes as one batched, replicated store.

Placement is rendezvous hashing over the live nodes (membership from etcd or a static list,
minus nodes this client has marked down). Every batched call becomes at most one request per
node, sent in parallel. Writes go to all R replicas; reads go to the first replica and, for
what it lacks or when it fails, to the next, while the other replicas are told to count the
read too, so their copies age like the one that served it (touch keys riding in the GET sent
to that node anyway, else a background TOUCH; see net/touch.py). Prefix lookups ask every
replica which keys it holds (EXISTS, one flag per key) and count the leading run of the
merged answer.

Drained nodes (``kvpool admin drain``; :meth:`Membership.drained_nodes`) get no new chunks:
writes are placed over the live nodes that are not drained. Reads still go to them: a key's
read list is its ranking over every live node down to the R-th node that is not drained, so
it names both the drained nodes that may hold its old copies and the nodes its new copies
were written to (rendezvous ranks of a subset are the full ranking with nodes left out).

Failure contract (DESIGN.md section 9): a dead, slow or misbehaving node never raises to the
caller. Its requests become misses (or are served by a replica), the node is marked down at
once and tried again after ``cluster.retry_down_s``. Only misconfiguration raises: a token the
nodes refuse (AuthError from ``register_namespace``), malformed keys or buffers (ValueError).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from kvpool.buffers import byte_view
from kvpool.checks import check_keys
from kvpool.cluster.etcd_membership import EtcdMembership
from kvpool.cluster.membership import Membership, StaticMembership
from kvpool.config import ClusterConfig
from kvpool.counters import Counters
from kvpool.errors import ChunkSizeError, PinLimitError
from kvpool.keys import Namespace
from kvpool.net.connection import NodeConnection, NodePool
from kvpool.net.placement import holders, replicas
from kvpool.net.protocol import RETAIN_BATCH_KEYS, AuthError, ProtocolError, RemoteError
from kvpool.net.read_repair import ReadRepairer
from kvpool.net.tls import client_tls
from kvpool.net.touch import ReplicaToucher
from kvpool.retention import Retention

log = logging.getLogger("kvpool.cluster")
T = TypeVar("T")


def membership_for(cfg: ClusterConfig) -> Membership:
    """etcd membership when endpoints are configured, else the static list. Raises EtcdError
    if etcd cannot be reached at start (an operator error, reported at once), ValueError for
    a malformed static address."""
    if cfg.etcd:
        return EtcdMembership(cfg.etcd, cfg.name, grace_s=cfg.grace_s)
    return StaticMembership(cfg.nodes)


class ClusterClient:
    """Thread-safe blocking client of a storage-node cluster."""

    def __init__(self, cfg: ClusterConfig, membership: Membership | None = None) -> None:
        self.cfg = cfg
        self.membership = membership if membership is not None else membership_for(cfg)
        self._tls = client_tls(cfg.tls)  # None: plain TCP; raises TlsConfigError
        self._pools: dict[str, NodePool] = {}
        self._down_until: dict[str, float] = {}
        self._runs: dict[str, tuple[str | None, str]] = {}  # node id -> (incarnation, address)
        self._replicas: dict[bytes, int] = {}
        self._lock = threading.Lock()
        self._fanout = ThreadPoolExecutor(cfg.fanout_threads, thread_name_prefix="kvpool-net")
        self._counters = Counters()  # bumped on fan-out threads too
        self._live_cache: tuple[float, list[str], frozenset[str]] | None = None
        self._toucher = ReplicaToucher(
            lambda node_id, ns, keys: self._safe(node_id, _touch_job(ns, keys)) is not None,
            cfg.touch_threads, cfg.touch_max_keys, cfg.touch_batch_keys)
        self._repairer = ReadRepairer(
            lambda node_id, ns, keys, datas: self._safe(node_id, _put_job(ns, keys, datas,
                                                                          cfg.batch_bytes)),
            cfg.read_repair_bytes, ready=lambda node_id: node_id in self.live_nodes(),
            max_age_s=cfg.repair_max_age_s)

    # ------------------------------------------------------------------ nodes
    def live_nodes(self) -> list[str]:
        """Node ids in placement now: live in membership and not marked down (a node whose
        retry time has come is live again; its next request is the probe). Recomputed at
        most every cluster.live_cache_s, and at once after a node is marked down."""
        return self._view()[0]

    def drained_nodes(self) -> frozenset[str]:
        """The live nodes that are drained (no new chunks placed on them), as of the same
        view as live_nodes."""
        return self._view()[1]

    def _view(self) -> tuple[list[str], frozenset[str]]:
        now = time.monotonic()
        cached = self._live_cache
        if cached is not None and now < cached[0]:
            return cached[1], cached[2]
        drained = self.membership.drained_nodes()
        out = []
        for node in self.membership.live_nodes():
            with self._lock:
                run = (node.incarnation, node.address())
                stale = None
                if self._runs.get(node.node_id, run) != run:
                    # a new run of the node (restarted) or a new address: the old run's
                    # connections and down mark say nothing about this one
                    stale = self._pools.pop(node.node_id, None)
                    self._down_until.pop(node.node_id, None)
                self._runs[node.node_id] = run
                if node.node_id not in self._pools:
                    c = self.cfg
                    self._pools[node.node_id] = NodePool(node.address(), c.token,
                                                         c.connections_per_node,
                                                         c.connect_timeout_s,
                                                         c.request_timeout_s,
                                                         c.socket_buffer_bytes, self._tls)
                if self._down_until.get(node.node_id, 0.0) <= now:
                    out.append(node.node_id)
            if stale is not None:
                log.info("node %s: new incarnation %s at %s; old connections closed",
                         node.node_id, node.incarnation, node.address(),
                         extra={"event": "node_incarnation", "node": node.node_id})
                stale.close()
        live_drained = drained.intersection(out)
        self._live_cache = (now + self.cfg.live_cache_s, out, live_drained)
        return out, live_drained

    def _mark_down(self, node_id: str, why: BaseException) -> None:
        with self._lock:
            already = self._down_until.get(node_id, 0.0) > time.monotonic()
            self._down_until[node_id] = time.monotonic() + self.cfg.retry_down_s
            self._live_cache = None
            pool = self._pools.get(node_id)
        self._counters.add("node_failures")
        if not already:
            log.warning("node %s marked down for %.1fs: %s", node_id, self.cfg.retry_down_s,
                        why)
        if pool is not None:
            pool.close()

    def _on_node(self, node_id: str, fn: Callable[[NodeConnection], T]) -> T | None:
        """Run ``fn`` on a pooled connection; None if the node failed (it is marked down)."""
        pool = self._pools.get(node_id)  # one dict read is atomic: no lock on the read path
        if pool is None:
            return None
        try:  # take / give_back rather than a generator context manager: per-request path
            conn, reused = pool.take_reused()
            try:
                result = fn(conn)
            except ConnectionError:
                conn.close()
                if not reused:
                    raise
                # An idle connection the node closed (it restarted): so are the others. Once
                # more on a new connection; reads and puts of content-addressed chunks may be
                # repeated.
                pool.close()
                conn = pool.take()
                try:
                    result = fn(conn)
                except BaseException:
                    conn.close()
                    raise
            except BaseException:
                conn.close()
                raise
            pool.give_back(conn)
        except (AuthError, PinLimitError):
            raise
        except RemoteError as exc:
            self._counters.add("remote_errors")
            log.warning("node %s refused a request: %s", node_id, exc)
            return None
        except (OSError, ProtocolError) as exc:  # timeouts and refused connects are OSErrors
            self._mark_down(node_id, exc)
            return None
        if node_id in self._down_until:  # a probe that succeeded: the node is back
            with self._lock:
                self._down_until.pop(node_id, None)
        return result

    def _safe(self, node_id: str, fn: Callable[[NodeConnection], T]) -> T | None:
        try:
            return self._on_node(node_id, fn)
        except AuthError as exc:  # refused mid-run (token rotated): a miss, loudly logged
            self._counters.add("auth_errors")
            log.error("node %s refused this client: %s", node_id, exc)
            return None

    def _fan_out(self, jobs: dict[str, Callable[[NodeConnection], T]]) -> dict[str, T | None]:
        if len(jobs) == 1:
            (node_id, fn), = jobs.items()
            return {node_id: self._safe(node_id, fn)}
        futures = {n: self._fanout.submit(self._safe, n, fn) for n, fn in jobs.items()}
        return {n: f.result() for n, f in futures.items()}

    # ------------------------------------------------------------------ namespaces
    def register_namespace(self, ns: Namespace, replicas: int | None = None) -> None:
        """Set the namespace's replication factor and check this client may use it on the
        live nodes. Raises AuthError if a node refuses the token or the tenant; nodes that
        are down are skipped (checked on first use)."""
        r = replicas or self.cfg.namespace_replicas.get(ns.model, self.cfg.replicas)
        self._replicas[ns.id] = r
        for node_id in self.live_nodes():
            self._on_node(node_id, lambda c: c.declare(ns))

    def _placement(self, ns: Namespace, keys: Sequence[bytes]) -> list[list[str]]:
        """Each key's read list: its replicas, plus the drained nodes ranked above them."""
        check_keys(keys)
        live, drained = self._view()
        r = self._replicas.get(ns.id, self.cfg.replicas)
        if not drained:
            return replicas(live, keys, r)
        return [_down_to_undrained(ranked, drained, r)
                for ranked in replicas(live, keys, r + len(drained))]

    def _write_placement(self, ns: Namespace, keys: Sequence[bytes]) -> list[list[str]]:
        """Each key's replicas among the live nodes that are not drained."""
        check_keys(keys)
        live, drained = self._view()
        nodes = [n for n in live if n not in drained] if drained else live
        return replicas(nodes, keys, self._replicas.get(ns.id, self.cfg.replicas))

    # ------------------------------------------------------------------ reads
    def exists_prefix(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        """Length of the leading run of ``keys`` that some live replica holds. Every replica
        of a key is asked whether it holds it (one batched EXISTS per node, in parallel), so
        a replica that lacks a key (it was down at write time, or the placement moved)
        hides nothing another replica holds. A failed node counts as not holding its keys."""
        if not keys:
            return 0
        check_keys(keys)
        keys = list(keys)
        live, drained = self._view()
        # With drained nodes, R + their number covers every read list (and asks a little more)
        per_node = holders(live, keys,
                           self._replicas.get(ns.id, self.cfg.replicas) + len(drained))
        jobs = {n: _exists_job(ns, keys if idx is None else [keys[i] for i in idx])
                for n, idx in per_node.items()}
        present = np.zeros(len(keys), dtype=bool)
        for node_id, held in self._fan_out(jobs).items():
            if held is None:
                continue
            idx = per_node[node_id]
            present[slice(None) if idx is None else idx] |= held
        self._counters.add("exists_calls")
        return len(keys) if present.all() else int(np.argmin(present))

    def get_many_into(self, ns: Namespace, keys: Sequence[bytes],
                      outs: Sequence[Any]) -> list[bool]:
        """Fetch chunks into ``outs`` (each exactly ns.chunk_bytes). False = miss (absent on
        every live replica, or every replica failed); the buffer's contents are then
        unspecified. Raises ChunkSizeError for a wrong-sized buffer."""
        views = [byte_view(o, writable=True) for o in outs]
        for view in views:
            if view.nbytes != ns.chunk_bytes:
                raise ChunkSizeError(f"output buffer has {view.nbytes} bytes; namespace chunks "
                                     f"have {ns.chunk_bytes}")
        live, drained = self._view()
        if len(live) == 1 and not drained and keys:
            # One live node (the common test and single-node deployment): every key's read
            # list is that node; no placement to compute.
            check_keys(keys)
            return self._get_from(live[0], ns, keys, views)
        placement = self._placement(ns, keys)
        first = placement[0] if placement else None
        if first is not None and len(first) == 1 and all(p == first for p in placement):
            # One read list for every key, of one node (one node, or one replica each and
            # the keys all on it): one GET, no touches, no later rank to ask.
            return self._get_from(first[0], ns, keys, views)
        touches = _replica_touches(keys, placement)
        found = [False] * len(keys)
        lacking: list[tuple[int, str]] = []  # (key index, live node that answered "not held")
        for rank in range(max((len(p) for p in placement), default=0)):
            per_node: defaultdict[str, list[int]] = defaultdict(list)
            for i, nodes in enumerate(placement):
                if not found[i] and rank < len(nodes):
                    per_node[nodes[rank]].append(i)
            if not per_node:
                break
            riding: dict[str, list[bytes]] = {}
            if rank == 0:  # touches ride in the GETs sent anyway; the rest go on their own
                batch = self.cfg.touch_batch_keys
                for node_id in per_node:
                    queued = touches.pop(node_id, [])
                    riding[node_id] = queued[:batch]
                    if queued[batch:]:
                        touches[node_id] = queued[batch:]
                if touches:
                    self._toucher.add(ns, touches)
            jobs = {n: _get_job(ns, [keys[i] for i in idx], [views[i] for i in idx],
                                riding.get(n, []), self.cfg.batch_bytes)
                    for n, idx in per_node.items()}
            for node_id, got in self._fan_out(jobs).items():
                if got is None:
                    continue
                for i, hit in zip(per_node[node_id], got, strict=True):
                    found[i] = hit
                    if not hit:
                        lacking.append((i, node_id))
        if lacking and self._repairer.enabled:
            self._read_repair(ns, keys, views, found, lacking)
        hits = sum(found)
        self._counters.add_many({"get_hits": hits, "get_misses": len(keys) - hits})
        return found

    def _get_from(self, node_id: str, ns: Namespace, keys: Sequence[bytes],
                  views: list[memoryview]) -> list[bool]:
        """Every key from one node, in one GET (or one per cluster.batch_bytes), counted:
        misses where the node fails (it is marked down)."""
        if len(keys) * ns.chunk_bytes <= self.cfg.batch_bytes:  # one request
            got = self._safe(node_id, lambda c: c.get_views(ns, keys, views))
        else:
            got = self._safe(node_id, _get_job(ns, list(keys), views, [], self.cfg.batch_bytes))
        found = got if got is not None else [False] * len(keys)
        hits = found.count(True)
        self._counters.add_many({"get_hits": hits, "get_misses": len(keys) - hits})
        return found

    def _read_repair(self, ns: Namespace, keys: Sequence[bytes], views: list[memoryview],
                     found: list[bool], lacking: list[tuple[int, str]]) -> None:
        """Queue each chunk a later replica served for the (undrained) replicas that
        answered without it (net/read_repair.py: copied now, sent in the background)."""
        drained = self.drained_nodes()
        for i, node_id in lacking:
            if found[i] and node_id not in drained:
                self._repairer.offer(node_id, ns, keys[i], views[i])

    # ------------------------------------------------------------------ writes
    def put_many(self, items: Iterable[tuple[bytes, Namespace, Any]]) -> int:
        """Write chunks to every live replica, one PUT per node and namespace, in parallel.
        Returns how many chunks at least one replica stored (the write-behind sink API)."""
        by_ns: dict[bytes, tuple[Namespace, list[bytes], list[Any]]] = {}
        for key, ns, data in items:
            entry = by_ns.setdefault(ns.id, (ns, [], []))
            entry[1].append(key)
            entry[2].append(data)
        stored = stored_bytes = 0
        for ns, keys, datas in by_ns.values():
            placement = self._write_placement(ns, keys)
            per_node: defaultdict[str, list[int]] = defaultdict(list)
            for i, nodes in enumerate(placement):
                for node_id in nodes:
                    per_node[node_id].append(i)
            jobs = {n: _put_job(ns, [keys[i] for i in idx], [datas[i] for i in idx],
                                self.cfg.batch_bytes)
                    for n, idx in per_node.items()}
            ok = [False] * len(keys)
            failed = set()
            for node_id, count in self._fan_out(jobs).items():
                if count is not None:
                    for i in per_node[node_id]:
                        ok[i] = True
                else:
                    failed.add(node_id)
            if self._repairer.enabled:
                self._hint(ns, keys, datas, placement, ok, failed)
            stored += sum(ok)
            stored_bytes += sum(byte_view(d).nbytes for d, done in zip(datas, ok, strict=True)
                                if done)
        self._counters.add_many({"put_chunks": stored, "put_bytes": stored_bytes})
        return stored

    def _hint(self, ns: Namespace, keys: list[bytes], datas: list[Any],
              placement: list[list[str]], ok: list[bool], failed: set[str]) -> None:
        """Leave a hint (net/read_repair.py) for each replica that missed a chunk another
        replica stored: one whose PUT failed, or one left out of the placement because it
        is marked down (a client cut from a node that is still in the cluster), so it gets
        the write once it answers again. Costs a dict scan when every node answered."""
        now = time.monotonic()
        with self._lock:
            down = {n for n, until in self._down_until.items() if until > now}
        if not failed and not down:
            return
        intended = placement
        if down:  # the placement the chunks would have had with every live node answering
            drained = self.membership.drained_nodes()
            nodes = [n.node_id for n in self.membership.live_nodes() if n.node_id not in drained]
            intended = replicas(nodes, keys, self._replicas.get(ns.id, self.cfg.replicas))
        missed = failed | down
        for i, owners in enumerate(intended):
            if ok[i]:
                for node_id in owners:
                    if node_id in missed:
                        self._repairer.offer(node_id, ns, keys[i], datas[i], hint=True)

    def retain(self, ns: Namespace, keys: Sequence[bytes], retention: Retention) -> int:
        """Send ``retention`` for ``keys`` to the nodes they are placed on (RETAIN, before
        or after their PUTs); keys recorded, summed over nodes. A node that fails is marked
        down (its copies keep the default retention); raises PinLimitError when a node refuses
        the pins."""
        if not keys:
            return 0
        placement = self._write_placement(ns, keys)
        per_node: defaultdict[str, list[bytes]] = defaultdict(list)
        for key, nodes in zip(keys, placement, strict=True):
            for node_id in nodes:
                per_node[node_id].append(key)
        wire = retention.to_mapping()
        results = self._fan_out({n: _retain_job(ns, k, wire) for n, k in per_node.items()})
        return sum(r or 0 for r in results.values())

    def release(self, ns: Namespace, session: str, delete: bool) -> int:
        """End ``session`` of the namespace's tenant on every live node; chunks released."""
        results = self._fan_out({n: (lambda c: c.release(ns, session, delete))
                                 for n in self.live_nodes()})
        return sum(r or 0 for r in results.values())

    def delete(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        """Delete from every live node (replicas may have moved); returns chunks removed."""
        results = self._fan_out({n: _delete_job(ns, list(keys)) for n in self.live_nodes()})
        return sum(r or 0 for r in results.values())

    def invalidate(self, ns: Namespace) -> int:
        results = self._fan_out({n: _invalidate_job(ns) for n in self.live_nodes()})
        return sum(r or 0 for r in results.values())

    # ------------------------------------------------------------------ admin
    def node_stats(self) -> dict[str, dict[str, Any] | None]:
        """STATS of every live node (None where a node failed)."""
        return self._fan_out({n: _stats_job for n in self.live_nodes()})

    def stats(self) -> dict[str, Any]:
        with self._lock:
            down = sorted(n for n, t in self._down_until.items() if t > time.monotonic())
        out: dict[str, Any] = self._counters.snapshot()
        out.update(self._toucher.counters)
        out.update(self._repairer.counters.snapshot(),
                   read_repair_pending_bytes=self._repairer.pending_bytes())
        out.update(live_nodes=self.live_nodes(), down_nodes=down,
                   drained_nodes=sorted(self.drained_nodes()),
                   touch_pending=self._toucher.pending())
        return out

    def close(self) -> None:
        self._repairer.close()
        self._toucher.close()
        self._fanout.shutdown(wait=True)
        with self._lock:
            pools = list(self._pools.values())
        for pool in pools:
            pool.close()
        self.membership.close()


def _down_to_undrained(ranked: list[str], drained: frozenset[str], count: int) -> list[str]:
    """``ranked`` up to and including its ``count``-th node that is not drained."""
    out, undrained = [], 0
    for node_id in ranked:
        out.append(node_id)
        if node_id not in drained:
            undrained += 1
            if undrained == count:
                break
    return out


# Jobs are built by functions so each closure captures its own batch.
def _exists_job(ns: Namespace, keys: list[bytes]) -> Callable[[NodeConnection], np.ndarray]:
    return lambda c: c.exists_flags(ns, keys)


def _replica_touches(keys: Sequence[bytes], placement: list[list[str]]) -> dict[str, list[bytes]]:
    """For each node, the keys it is a second (or later) replica of. A read fetches each
    chunk from one replica; the others are touched so their copies stay as recent as the one
    it fetched: unread copies would be the first evicted, and a failover would find them
    gone."""
    per_node: defaultdict[str, list[bytes]] = defaultdict(list)
    for key, nodes in zip(keys, placement, strict=True):
        for node_id in nodes[1:]:
            per_node[node_id].append(key)
    return per_node


def _touch_job(ns: Namespace, keys: list[bytes]) -> Callable[[NodeConnection], int]:
    return lambda c: c.touch(ns, keys)


def _batches(ns: Namespace, n: int, batch_bytes: int) -> list[slice]:
    """Requests of at most ``batch_bytes`` of payload (cluster.batch_bytes; nodes refuse
    answers over server.max_inflight_bytes), at least one chunk each."""
    step = max(1, batch_bytes // max(1, ns.chunk_bytes))
    return [slice(i, i + step) for i in range(0, n, step)]


def _get_job(ns: Namespace, keys: list[bytes], views: list[memoryview], touch: list[bytes],
             batch_bytes: int) -> Callable[[NodeConnection], list[bool]]:
    """The first batch carries the node's touch keys."""
    if len(keys) * ns.chunk_bytes <= batch_bytes or len(keys) == 1:  # one request
        return lambda c: c.get_views(ns, keys, views, touch)
    return lambda c: [hit for j, b in enumerate(_batches(ns, len(keys), batch_bytes))
                      for hit in c.get_views(ns, keys[b], views[b], touch if j == 0 else ())]


def _put_job(ns: Namespace, keys: list[bytes], datas: list[Any],
             batch_bytes: int) -> Callable[[NodeConnection], int]:
    return lambda c: sum(c.put(ns, keys[b], datas[b])
                         for b in _batches(ns, len(keys), batch_bytes))


def _retain_job(ns: Namespace, keys: list[bytes],
                retention: dict[str, Any]) -> Callable[[NodeConnection], int]:
    return lambda c: sum(c.retain(ns, keys[i:i + RETAIN_BATCH_KEYS], retention)
                         for i in range(0, len(keys), RETAIN_BATCH_KEYS))


def _delete_job(ns: Namespace, keys: list[bytes]) -> Callable[[NodeConnection], int]:
    return lambda c: c.delete(ns, keys)


def _invalidate_job(ns: Namespace) -> Callable[[NodeConnection], int]:
    return lambda c: c.invalidate(ns)


def _stats_job(c: NodeConnection) -> dict[str, Any]:
    return c.stats()
