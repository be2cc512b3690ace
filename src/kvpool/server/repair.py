"""Node-side repair: re-replication after a membership change, and a drained node's copying.

One daemon thread per node (:class:`NodeRepair`), started after the node registers in etcd,
watches the node's own membership view (live nodes, drained nodes). ``cluster.repair_delay_s``
after the last change it saw (joins, leaves, drains; also once after the node starts) it makes
one *pass* over the chunks it stores (the key catalog, server/catalog.py):

1. Each chunk's owners under the new view: the first R nodes of its rendezvous ranking over
   the live nodes that are not drained (R: ``cluster.namespace_replicas`` for the
   namespace's model, else ``cluster.replicas``, read from the node's own config: run the
   fleet, clients included, from one YAML). Its *read list*: its ranking over every live node
   down to the R-th owner (the drained nodes ranked above them included), as clients read.
2. A chunk needs checking when an owner is new to it (not an owner under the previous view)
   or joined since the previous pass (it may have restarted empty: a node that restarted
   is told apart by its incarnation, so a restart quicker than ``repair_delay_s``, or one
   while a pass was failing and being retried, is still seen); every chunk after the
   node starts, and every chunk while the node is drained.
3. The node asks every other node of the read list which of those chunks it holds (EXISTS,
   batched per node).
4. **Sender rule**: a chunk is sent by the first node holding it in this order: the drained
   nodes of its read list (they are leaving), then its owners by rank, then anyone else (a
   former owner). So a node sends a chunk to the owners that lack it only if no node ahead
   of it in that order holds it (an owner ranked above it, or a drained node of the read
   list); a drained node sends each of its chunks to every owner that lacks it. Two holders
   outside the order (former owners both) may both send; a PUT of a stored chunk stores
   nothing twice.
5. Copies go hottest first (chunks in the node's DRAM first, then the rest, newest first),
   as ordinary PUTs over the client protocol (net/connection.py) with ``cluster.token``, at
   most ``cluster.repair_bytes_per_s`` bytes per second (a token bucket). With auth on the
   peers must accept that token for the tenants of the namespaces the node stores.

Reading a chunk to copy it neither promotes it into DRAM nor counts as a hit
(KVPool.peek_many_into). Nothing here runs on the event loop or holds a lock across a peer
request: requests are only slowed down by the bytes the copies read and send.

A drained node (``kvpool admin drain``) repeats its pass until one completes with every chunk
on all of its owners and no new chunk arrived meanwhile, and reports its progress in etcd
under ``/kvpool/<cluster>/drain_status/<node_id>`` (JSON: ``state`` copying / done / blocked,
``copied``, ``failed``, ``chunks``, ``at``), which ``kvpool admin drain`` waits for.

Failure contract: nothing here raises out of the thread. A peer that fails (down, refusing,
timing out) is skipped for the rest of the pass, its copies counted as failures
(``kvpool_repair_failures_total``), and the pass is tried again 5 s later; a chunk that no
longer reads is forgotten. Metrics: ``kvpool_repair_chunks_total{kind}``,
``kvpool_repair_bytes_total``, ``kvpool_repair_pending_chunks``,
``kvpool_repair_failures_total``, ``kvpool_repair_passes_total`` (docs/operations.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvpool.cluster.membership import NodeInfo
from kvpool.config import Config
from kvpool.counters import Counters
from kvpool.keys import Namespace
from kvpool.metrics.families import Families
from kvpool.net.connection import NodePool
from kvpool.net.placement import replicas
from kvpool.net.protocol import ProtocolError, RemoteError
from kvpool.pool import KVPool
from kvpool.server.catalog import Entry, KeyCatalog
from kvpool.server.drain_status import DrainStatus

log = logging.getLogger("kvpool.serve")

#: How often the thread looks at the membership view.
POLL_S = 0.2
#: A pass that had failures is tried again this much later.
RETRY_S = 5.0
#: The catalog is saved at most this often (when it changed).
SAVE_EVERY_S = 10.0
#: The catalog is pruned (entries of chunks no tier holds dropped) when it doubled since the
#: last prune, and holds at least this many entries.
PRUNE_MIN = 4096
#: Keys per EXISTS probe and per placement computation.
CHECK_BATCH = 1024
#: Payload bytes per PUT a repair sends (at least one chunk).
SEND_BYTES = 4 << 20


@dataclass(frozen=True)
class View:
    """One membership view: live node id -> address, the drained ids among them, and each
    live node's incarnation (its run: a node restarted since is another view even when it
    came back before anyone saw it gone)."""

    live: dict[str, str]
    drained: frozenset[str]
    incarnations: dict[str, str | None] = field(default_factory=dict)

    def joined_since(self, old: View) -> set[str]:
        """The live nodes that were not live in ``old``, or were another run of the node
        (restarted: it may have come back without what it held)."""
        return {n for n in self.live if n not in old.live
                or self.incarnations.get(n) != old.incarnations.get(n)}


@dataclass
class Outcome:
    """What one pass did."""

    checked: int = 0
    copied: int = 0
    failed: int = 0
    stuck: bool = False  # a chunk had no owner to go to (no undrained peer)
    failed_peers: set[str] = field(default_factory=set)


class TokenBucket:
    """``rate`` bytes per second, bursts of up to one second's worth (or one request)."""

    def __init__(self, rate: int, stop: threading.Event) -> None:
        self.rate = rate
        self._stop = stop
        self._tokens = float(rate)
        self._last = time.monotonic()

    def take(self, nbytes: int) -> bool:
        """Wait until ``nbytes`` may be sent; False if the repair is stopping meanwhile."""
        now = time.monotonic()
        self._tokens = min(float(max(self.rate, nbytes)),
                           self._tokens + (now - self._last) * self.rate)
        self._last = now
        self._tokens -= nbytes
        if self._tokens < 0:
            return not self._stop.wait(-self._tokens / self.rate)
        return not self._stop.is_set()


class Peers:
    """Connections to the other nodes (one NodePool each), with cluster.token."""

    def __init__(self, config: Config) -> None:
        c = config.cluster
        self._args = (c.token, 2, c.connect_timeout_s, c.request_timeout_s,
                      c.socket_buffer_bytes)
        self._pools: dict[str, NodePool] = {}

    def _pool(self, address: str) -> NodePool:
        pool = self._pools.get(address)
        if pool is None:
            pool = self._pools[address] = NodePool(address, *self._args)
        return pool

    def exists(self, address: str, ns: Namespace, keys: list[bytes]) -> np.ndarray:
        """Which of ``keys`` the node holds. Raises OSError / ProtocolError / RemoteError."""
        with self._pool(address).connection() as conn:
            return conn.exists_flags(ns, keys)

    def put(self, address: str, ns: Namespace, keys: list[bytes], datas: list[Any]) -> int:
        with self._pool(address).connection() as conn:
            return conn.put(ns, keys, datas)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


class NodeRepair:
    """The repair thread of one node (see the module docstring)."""

    def __init__(self, node_id: str, pool: KVPool, catalog: KeyCatalog,
                 view: Callable[[], View], config: Config,
                 status: DrainStatus | None = None) -> None:
        self.node_id = node_id
        self.pool = pool
        self.catalog = catalog
        self._view = view
        self.config = config
        self._status = status
        self._stop = threading.Event()
        self._bucket = TokenBucket(config.cluster.repair_bytes_per_s, self._stop)
        self._peers = Peers(config)
        self.counters = Counters("rereplicate_chunks", "drain_chunks", "bytes", "failures",
                                 "passes")
        self._pending = 0
        self._thread = threading.Thread(target=self._run, name="kvpool-repair", daemon=True)

    # ------------------------------------------------------------------ lifecycle
    def set_rate(self, bytes_per_s: int) -> None:
        """A new ``cluster.repair_bytes_per_s`` (SIGHUP), from the next copy on. Raises
        ValueError for a rate that is not positive (0 turns repair off: that needs a
        restart)."""
        if bytes_per_s <= 0:
            raise ValueError("cluster.repair_bytes_per_s must stay > 0 while repair runs")
        self._bucket.rate = int(bytes_per_s)

    def start(self) -> NodeRepair:
        self._thread.start()
        return self

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop (a copy in flight finishes or times out) and save the catalog."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._peers.close()
        self.catalog.save()

    def metrics(self) -> dict[str, int]:
        out = self.counters.snapshot()
        out["pending"] = self._pending
        return out

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            self._loop()
        except Exception:  # a bug must not kill the node; it is loud instead
            log.exception("the repair thread failed; no more repair until a restart")

    def _loop(self) -> None:
        delay = self.config.cluster.repair_delay_s
        done: View | None = None  # the view the last complete pass repaired for
        seen: View | None = None
        changed_at = time.monotonic()
        retry_at = 0.0
        drain_generation = -1  # catalog generation the last complete drain pass covered
        drain_copied = drain_failed = 0
        saved_at = time.monotonic()
        pruned_size = len(self.catalog)
        while not self._stop.wait(POLL_S):
            now = time.monotonic()
            if now - saved_at >= SAVE_EVERY_S and self.catalog.dirty():
                if len(self.catalog) > max(PRUNE_MIN, 2 * pruned_size):
                    for _ in self._held_by_namespace():  # forgets what no tier holds
                        pass
                    pruned_size = len(self.catalog)
                self.catalog.save()
                saved_at = now
            view = self._view()
            if view != seen:
                seen, changed_at = view, now
                if self.node_id not in view.drained:
                    drain_generation, drain_copied, drain_failed = -1, 0, 0
            if now - changed_at < delay or now < retry_at:
                continue
            draining = self.node_id in view.drained
            generation = self.catalog.generation
            if view == done and not (draining and generation != drain_generation):
                continue
            if draining and self._status is not None:
                self._status.report("copying", copied=drain_copied, failed=drain_failed,
                                    chunks=len(self.catalog))
            try:
                outcome = self._pass(done if view != done else None, view)
            except Exception:  # a bug or a closing pool: logged, the pass tried again later
                log.exception("repair pass failed")
                outcome = Outcome(failed=1)
            self.counters.add("passes")
            if self._stop.is_set():
                return
            if draining:
                drain_copied += outcome.copied
                drain_failed += outcome.failed
            if outcome.failed or outcome.failed_peers or outcome.stuck:
                retry_at = time.monotonic() + RETRY_S
                if draining and self._status is not None:
                    self._status.report("blocked" if outcome.stuck else "copying",
                                        copied=drain_copied, failed=drain_failed,
                                        chunks=outcome.checked)
                continue
            if draining and outcome.copied:
                retry_at = time.monotonic() + POLL_S  # once more: a pass that copies
                continue  # nothing says the owners hold all
            done = view
            if draining:
                drain_generation = generation
                if self._status is not None:
                    self._status.report("done", copied=drain_copied, failed=drain_failed,
                                        chunks=outcome.checked)
                    log.info("drain of node %s done: %d chunks copied", self.node_id,
                             drain_copied)

    # ------------------------------------------------------------------ one pass
    def _pass(self, old: View | None, new: View) -> Outcome:
        """Check and copy the chunks of the catalog for ``new`` (``old``: the view of the
        last complete pass; None: check everything)."""
        out = Outcome()
        draining = self.node_id in new.drained
        if not any(n != self.node_id and n not in new.drained for n in new.live):
            out.stuck = bool(len(self.catalog)) and draining
            return out
        hot: list[tuple[Namespace, list[Entry]]] = []
        cold: list[tuple[Namespace, list[Entry]]] = []
        for ns, entries in self._held_by_namespace():
            try:
                resident = self.pool.resident_many(ns, [e[0] for e in entries])
            except Exception:  # the namespace was just forgotten by the registry
                resident = [False] * len(entries)
            hot.append((ns, [e for e, r in zip(entries, resident, strict=True) if r]))
            cold.append((ns, [e for e, r in zip(entries, resident, strict=True) if not r]))
        for ns, entries in (*hot, *cold):
            for i in range(0, len(entries), CHECK_BATCH):
                if self._stop.is_set():
                    return out
                self._repair_batch(ns, entries[i:i + CHECK_BATCH], old, new, out)
        if out.copied or out.failed:
            log.info("repair pass: %d chunks checked, %d copied, %d failed%s", out.checked,
                     out.copied, out.failed,
                     f" (peers failing: {', '.join(sorted(out.failed_peers))})"
                     if out.failed_peers else "")
        return out

    def _held_by_namespace(self) -> Iterator[tuple[Namespace, list[Entry]]]:
        """The catalog's entries grouped by namespace (newest first), less the chunks no
        tier holds any more (forgotten)."""
        groups: defaultdict[bytes, list[Entry]] = defaultdict(list)
        for entry in self.catalog.entries():
            groups[entry[1]].append(entry)
        for ns_id, entries in groups.items():
            ns = self.catalog.namespace(ns_id)
            if ns is None:
                continue
            try:
                self.pool.register_namespace(ns)
                held = [h for i in range(0, len(entries), CHECK_BATCH)
                        for h in self.pool.contains_many(
                            ns, [e[0] for e in entries[i:i + CHECK_BATCH]])]
            except Exception as exc:  # closed pool, a namespace no tier fits any more
                log.warning("repair skips namespace %s: %s", ns_id.hex(), exc)
                continue
            self.catalog.forget([e[0] for e, h in zip(entries, held, strict=True) if not h])
            kept = [e for e, h in zip(entries, held, strict=True) if h]
            if kept:
                yield ns, kept

    def _replicas(self, ns: Namespace) -> int:
        c = self.config.cluster
        return c.namespace_replicas.get(ns.model, c.replicas)

    def _repair_batch(self, ns: Namespace, entries: list[Entry], old: View | None, new: View,
                      out: Outcome) -> None:
        me, r = self.node_id, self._replicas(ns)
        draining = me in new.drained
        keys = [e[2] for e in entries]
        live = sorted(new.live)
        ranked = replicas(live, keys, len(live))
        old_owners: list[list[str]] | None = None
        joined: set[str] = set()
        if old is not None and not draining:
            joined = new.joined_since(old)
            old_live = sorted(old.live)
            old_owners = [[n for n in rank if n not in old.drained][:r]
                          for rank in replicas(old_live, keys, len(old_live))]
        plans: list[tuple[list[str], list[str]]] = []  # per key: (owners, read list)
        asks: defaultdict[str, list[int]] = defaultdict(list)
        for i, rank in enumerate(ranked):
            owners, read_list = _owners(rank, new.drained, r)
            plans.append((owners, read_list))
            if old_owners is not None and not any(
                    o != me and (o in joined or o not in old_owners[i]) for o in owners):
                continue  # its owners held it before and none of them restarted since
            for n in read_list:
                if n != me:
                    asks[n].append(i)
        if not asks:
            return
        held: dict[str, np.ndarray] = {}
        for node_id, idx in asks.items():
            if node_id in out.failed_peers:
                continue
            try:
                held[node_id] = self._peers.exists(new.live[node_id], ns,
                                                   [keys[i] for i in idx])
            except (OSError, ProtocolError, RemoteError) as exc:
                self._peer_failed(node_id, exc, out)
        holds: defaultdict[int, set[str]] = defaultdict(set)
        checked: set[int] = set()
        for node_id, flags in held.items():
            for i, flag in zip(asks[node_id], flags.tolist(), strict=True):
                checked.add(i)
                if flag:
                    holds[i].add(node_id)
        sends: defaultdict[int, list[str]] = defaultdict(list)  # key index -> owners lacking
        for i in sorted(checked):
            owners, read_list = plans[i]
            out.checked += 1
            if not draining:
                order = [n for n in read_list if n in new.drained] + owners
                ahead = order[:order.index(me)] if me in owners else order
                if any(n in holds[i] for n in ahead):
                    continue
            sends[i] = [n for n in owners if n != me and n not in holds[i]
                        and n in held]  # a peer that did not answer is not sent to
        self._send(ns, entries, keys, sends, new, draining, out)

    def _send(self, ns: Namespace, entries: list[Entry], keys: list[bytes],
              sends: dict[int, list[str]], new: View, draining: bool, out: Outcome) -> None:
        todo = [i for i, targets in sorted(sends.items()) if targets]
        copies = sum(len(sends[i]) for i in todo)
        self._pending += copies
        try:
            step = max(1, SEND_BYTES // ns.chunk_bytes)
            for start in range(0, len(todo), step):
                part = todo[start:start + step]
                bufs = [bytearray(ns.chunk_bytes) for _ in part]
                try:
                    found = self.pool.peek_many_into(ns, [entries[i][0] for i in part], bufs)
                except Exception as exc:  # a read error: those chunks are not copied now
                    log.warning("repair cannot read chunks of namespace %s: %s",
                                ns.id.hex(), exc)
                    found = [False] * len(part)
                per_node: defaultdict[str, list[int]] = defaultdict(list)
                for j, i in enumerate(part):
                    if not found[j]:
                        self._pending -= len(sends[i])
                        copies -= len(sends[i])
                        continue
                    for node_id in sends[i]:
                        per_node[node_id].append(j)
                for node_id, js in per_node.items():
                    if self._stop.is_set():
                        return
                    if node_id in out.failed_peers \
                            or not self._bucket.take(len(js) * ns.chunk_bytes):
                        out.failed += len(js)
                        self.counters.add("failures", len(js))
                    else:
                        self._put(node_id, new, ns, [keys[part[j]] for j in js],
                                  [bufs[j] for j in js], draining, out)
                    self._pending -= len(js)
                    copies -= len(js)
        finally:
            self._pending -= copies

    def _put(self, node_id: str, new: View, ns: Namespace, keys: list[bytes],
             datas: list[bytearray], draining: bool, out: Outcome) -> None:
        try:
            stored = self._peers.put(new.live[node_id], ns, keys, datas)
        except (OSError, ProtocolError, RemoteError) as exc:
            self._peer_failed(node_id, exc, out)
            out.failed += len(keys)
            self.counters.add("failures", len(keys))
            return
        out.copied += stored
        kind = "drain_chunks" if draining else "rereplicate_chunks"
        self.counters.add_many({kind: stored, "bytes": stored * ns.chunk_bytes,
                                "failures": len(keys) - stored})
        out.failed += len(keys) - stored

    def _peer_failed(self, node_id: str, exc: BaseException, out: Outcome) -> None:
        if node_id not in out.failed_peers:
            log.warning("repair: node %s failed, skipped for this pass: %s", node_id, exc)
        out.failed_peers.add(node_id)


def _owners(rank: Sequence[str], drained: frozenset[str],
            r: int) -> tuple[list[str], list[str]]:
    """(the first ``r`` undrained nodes of ``rank``, ``rank`` down to the last of them)."""
    owners: list[str] = []
    read_list: list[str] = []
    for node_id in rank:
        read_list.append(node_id)
        if node_id not in drained:
            owners.append(node_id)
            if len(owners) == r:
                break
    return owners, read_list


def membership_view(membership: Any) -> Callable[[], View]:
    """A ``view`` function over an EtcdMembership (or any Membership)."""
    def view() -> View:
        nodes: list[NodeInfo] = membership.live_nodes()
        live = {n.node_id: n.address() for n in nodes}
        return View(live, frozenset(membership.drained_nodes()) & frozenset(live),
                    {n.node_id: n.incarnation for n in nodes})
    return view


class RepairCollector(Collector):
    """The repair metrics of a node (zeros when it runs no repair)."""

    def __init__(self, repair: Callable[[], NodeRepair | None]) -> None:
        self._repair = repair

    def collect(self) -> Iterator[Metric]:
        repair = self._repair()
        m = repair.metrics() if repair is not None else {}
        out = Families()
        out.add("kvpool_repair_chunks_total", m.get("rereplicate_chunks", 0), "rereplicate")
        out.add("kvpool_repair_chunks_total", m.get("drain_chunks", 0), "drain")
        out.add("kvpool_repair_bytes_total", m.get("bytes", 0))
        out.add("kvpool_repair_pending_chunks", m.get("pending", 0))
        out.add("kvpool_repair_failures_total", m.get("failures", 0))
        out.add("kvpool_repair_passes_total", m.get("passes", 0))
        return iter(out)


def start_node_repair(config: Config, node_id: str, pool: KVPool, membership: Any,
                      scope: Callable[[bytes, bytes], bytes]) -> NodeRepair | None:
    """The node's catalog (loaded from the SSD dir) and repair thread, started; None when
    the node has no etcd membership or ``cluster.repair_bytes_per_s`` is 0."""
    if membership is None or config.cluster.repair_bytes_per_s <= 0:
        return None
    path = config.ssd_path() / "repair-catalog" if config.ssd.enabled else None
    catalog = KeyCatalog(path, scope)
    loaded = catalog.load()
    if loaded:
        log.info("repair catalog: %d chunks known from %s", loaded, path)
    return NodeRepair(node_id, pool, catalog, membership_view(membership), config,
                      DrainStatus(config.cluster.etcd, config.cluster.name, node_id)).start()
