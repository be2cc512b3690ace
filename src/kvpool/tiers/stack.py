"""Which tiers a pool has, in which order, and who receives each put: the one place that reads
the tier settings of a Config (DESIGN.md sections 4-5).

Read order, fastest first: DRAM, the SSD's write-behind staging, the cluster's staging, the SSD
engine, the storage nodes. Every put lands in DRAM (the front tier) and is also written to the
``through`` tiers: the cluster's staging always, the SSD's staging with ``pool.ssd_write:
through`` (or no DRAM), the SSD engine itself, synchronously, for durable puts. DRAM victims
not already on a lower tier go to the SSD's staging, as the admission policy allows
(``Demoter``): eviction hands chunks down, it never calls up into the pool.

The SSD and the cluster each have their own staging queue, side by side, never in series: a
paused storage node fills the cluster's queue, never the SSD's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvpool.config import Config
from kvpool.counters import Counters
from kvpool.errors import PoolClosedError
from kvpool.keys import Namespace
from kvpool.policy import AdmissionPolicy, make_admission_policy, resolve_eviction_policy
from kvpool.retention import RetentionBook, TenantQuotas
from kvpool.ssd.engine import SsdEngine
from kvpool.tiers.base import Tier
from kvpool.tiers.dram import DramTier
from kvpool.tiers.remote import RemoteTier
from kvpool.tiers.slots import PinnedView
from kvpool.tiers.ssd import SsdTier
from kvpool.tiers.staging import WriteBehind

log = logging.getLogger(__name__)


#: ``holds(key, namespace_id)``: does the demotion target (the SSD, its queue included) still
#: hold the chunk?
Holds = Callable[[bytes, bytes], bool]


class Demoter:
    """The DRAM tier's demotion sink: victims no lower tier holds yet are offered to
    ``targets`` (staging queues, which never block), if ``admission`` admits them.

    A victim marked as held below (``on_lower``: written through, demoted or promoted from
    the SSD) is checked with ``holds``: if the SSD evicted its record while DRAM served it,
    the victim is written back like any other demotion (admission permitting), counted as
    ``written_back``. A failing check (the SSD closed meanwhile) counts as held."""

    def __init__(self, admission: AdmissionPolicy, targets: Sequence[Tier],
                 holds: Holds | None = None) -> None:
        self._admission = admission
        self._targets = list(targets)
        self._holds = holds
        #: Called with each batch before it is offered to the targets (the pool keeps
        #: tenants within their SSD quotas there: retention/quotas.py); None: nothing.
        self.before_write: Callable[[Sequence[tuple[bytes, Namespace, memoryview]]],
                                    object] | None = None
        #: Victims handed to the targets (each target may still drop it, counted there);
        #: written_back: those of them the SSD had held and evicted while DRAM served them.
        self.demoted = Counters("demotions", "written_back")

    def _lost_below(self, key: bytes, ns: Namespace) -> bool:
        if self._holds is None:
            return False
        try:
            return not self._holds(key, ns.id)
        except PoolClosedError:
            return False

    def demote(self, key: bytes, ns: Namespace, payload: memoryview, hits: int,
               on_lower: bool) -> None:
        if not self._targets:
            return
        lost = on_lower and self._lost_below(key, ns)
        if (on_lower and not lost) or not self._admission.admit(key, hits):
            return
        self.demoted.add_many({"demotions": 1, "written_back": int(lost)})
        if self.before_write is not None:
            self.before_write([(key, ns, payload)])
        for target in self._targets:
            target.put_many([(key, ns, payload)])

    def write_back(self, front: DramTier, keys: Sequence[bytes]) -> int:
        """Offer the chunks ``front`` still holds among ``keys`` (records the SSD dropped
        although they were read: over the copy-forward budget) to the targets, as the
        admission policy allows, counted as ``written_back``. Returns how many were offered;
        a closed tier ends it early, nothing is raised for it."""
        if not self._targets:
            return 0
        offered = 0
        try:
            for key in keys:
                found = front.view_to_copy(key)
                if found is None:
                    continue
                ns, hits, view = found
                try:
                    if self._admission.admit(key, hits):
                        if self.before_write is not None:
                            self.before_write([(key, ns, view.data)])
                        for target in self._targets:
                            target.put_many([(key, ns, view.data)])
                        offered += 1
                finally:
                    view.release()
        except PoolClosedError:
            pass
        if offered:
            self.demoted.add_many({"demotions": offered, "written_back": offered})
        return offered


@dataclass
class TierStack:
    #: Every tier in read order (the front first).
    tiers: list[Tier]
    #: The DRAM tier, which also pins chunks in place and reserves slots; None without DRAM.
    front: DramTier | None
    #: Tiers every put is written to, besides the front (fastest answer first).
    through: list[Tier] = field(default_factory=list)
    #: For durable puts: the tier whose write decides a put's answer.
    ack: Tier | None = None
    #: The local SSD tier (None without one): what a warm start reads DRAM's chunks from.
    ssd: SsdTier | None = None
    #: The SSD that ``close`` writes the chunks only DRAM holds to (None without DRAM or SSD).
    drain_to: SsdTier | None = None
    #: The SSD's write-behind queue: chunks in it are on their way to ``drain_to``.
    drain_staging: WriteBehind | None = None
    #: How long ``close`` may spend on that (``pool.close_drain_s``).
    drain_s: float = 0.0
    #: Chunks per write of the close drain.
    drain_batch: int = 16
    #: The DRAM tier's demotion sink (None without DRAM).
    demoter: Demoter | None = None
    #: The storage nodes' tier (None without a cluster): retention requests go to it.
    remote: RemoteTier | None = None

    def write_back_dropped(self) -> int:
        """Write back, through the SSD's write-behind queue, the chunks DRAM holds whose SSD
        records were dropped over the copy-forward budget (``SsdEngine.take_hot_dropped``),
        so a restart finds them; costs a length check when there are none. Returns how
        many were offered; never raises."""
        if self.demoter is None or self.front is None or self.ssd is None:
            return 0
        keys = self.ssd.engine.take_hot_dropped()
        return self.demoter.write_back(self.front, keys) if keys else 0

    def lower(self) -> list[Tier]:
        return [t for t in self.tiers if t is not self.front]

    def only_in_front(self) -> list[tuple[bytes, Namespace]]:
        """The DRAM chunks the SSD does not hold, in put order: never written below
        (``ssd_write: evict``, or a write-through save dropped), or written but evicted
        from the SSD's log while DRAM served them. Chunks in the SSD's write-behind queue
        are held (its close writes them)."""
        front, ssd, staging = self.front, self.drain_to, self.drain_staging
        if front is None or ssd is None:
            return []
        resident = front.residents()
        by_ns: dict[bytes, list[int]] = {}
        for i, (_, ns, on_lower) in enumerate(resident):
            if on_lower:
                by_ns.setdefault(ns.id, []).append(i)
        lost: set[int] = set()
        for ns_id, where in by_ns.items():
            keys = [resident[i][0] for i in where]
            held = ssd.contains_many(keys, ns_id)
            queued = staging.contains_many(keys, ns_id) if staging is not None \
                else [False] * len(keys)
            lost.update(i for i, a, b in zip(where, held, queued, strict=True)
                        if not (a or b))
        return [(key, ns) for i, (key, ns, on_lower) in enumerate(resident)
                if not on_lower or i in lost]

    def drain_front(self) -> tuple[int, int]:
        """Write the chunks only DRAM holds (``only_in_front``) to ``drain_to``, in put
        order, for at most ``drain_s`` seconds. Returns (written, left behind). A failed
        write is logged by the SSD tier and counted as left behind; nothing is raised."""
        front, ssd = self.front, self.drain_to
        if front is None or ssd is None or self.drain_s <= 0:
            return 0, 0
        todo = self.only_in_front()
        deadline = time.monotonic() + self.drain_s
        written = 0
        for start in range(0, len(todo), self.drain_batch):
            if time.monotonic() >= deadline:
                break
            views: list[PinnedView] = []
            items = []
            for key, ns in todo[start:start + self.drain_batch]:
                view = front.view(key, ns.id, count_miss=False)
                if view is not None:  # deleted or evicted (and demoted) meanwhile
                    views.append(view)
                    items.append((key, ns, view.data))
            try:
                written += sum(ssd.put_many(items))
            finally:
                for view in views:
                    view.release()
        left = len(todo) - written
        if todo:
            log.log(logging.WARNING if left else logging.INFO,
                    "kvpool close: wrote %d DRAM-only chunks to SSD, %d left behind (%.1f s "
                    "budget, pool.close_drain_s)", written, left, self.drain_s)
        return written, left

    def close(self) -> None:
        """Drain DRAM-only chunks to the SSD (``drain_front``), then close in read order: a
        staging queue drains into its sink before the sink closes. Every tier is closed
        even if one fails; the first error is raised after."""
        error: BaseException | None = None
        try:
            self.drain_front()
        except BaseException as exc:
            error = exc
        for tier in self.tiers:
            try:
                tier.close()
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error


def build_tiers(cfg: Config, remote: bool = True, retention: RetentionBook | None = None,
                quotas: TenantQuotas | None = None) -> TierStack:
    """The tiers ``cfg`` asks for; DRAM honours ``retention`` and ``quotas`` when given.
    Raises what the tiers raise when they cannot be opened
    (OSError, ValueError, CacheDirLockedError, InsufficientSpaceError, ...), after closing the
    ones already open."""
    stack = TierStack([], None)
    ssd_staging: WriteBehind | None = None
    try:
        if cfg.ssd.enabled:
            ssd = stack.ssd = SsdTier(SsdEngine.from_config(cfg))
            # Write-through saves of chunks DRAM holds are queued as pinned slots (the SSD
            # writes straight from DRAM, no staging copy), up to a quarter of DRAM, so
            # eviction always has unpinned slots to take; beyond it they are copied.
            pinnable = cfg.dram.capacity // 4 if cfg.pool.ssd_write == "through" \
                and cfg.ssd.durability == "cache" else 0
            ssd_staging = WriteBehind(ssd.engine, cfg.pool.write_behind_bytes,
                                      cfg.pool.write_behind_batch,
                                      nice=cfg.pool.background_nice, max_pinned=pinnable,
                                      writers=cfg.pool.write_behind_threads)
            stack.tiers[:0] = [ssd_staging, ssd]
            if cfg.pool.ssd_write == "through" or cfg.dram.capacity == 0:
                durable = cfg.ssd.durability == "durable"
                stack.through.append(ssd if durable else ssd_staging)
                stack.ack = ssd if durable else None
            # in both modes: what the SSD lacks (never written, or evicted from its log
            # while DRAM served it) is written at close
            stack.drain_to, stack.drain_s = ssd, cfg.pool.close_drain_s
            stack.drain_staging = ssd_staging
            stack.drain_batch = cfg.pool.write_behind_batch
        if remote and cfg.cluster.enabled:
            nodes = stack.remote = RemoteTier(cfg.cluster)
            stack.tiers.append(nodes)
            staging = WriteBehind(nodes.client, cfg.cluster.write_behind_bytes,
                                  cfg.pool.write_behind_batch, label="cluster",
                                  stats_key=("remote", "write_behind"),
                                  nice=cfg.pool.background_nice)
            stack.tiers.insert(1 if ssd_staging is not None else 0, staging)
            stack.through.append(staging)
        if cfg.dram.capacity > 0:
            d = cfg.dram
            admission = make_admission_policy(cfg.ssd.admission, cfg.ssd.second_use_window)
            holds = None
            if ssd_staging is not None and stack.ssd is not None:
                queued, engine = ssd_staging.contains, stack.ssd.engine.contains

                def holds(key: bytes, ns_id: bytes) -> bool:
                    return queued(key, ns_id) or engine(key, ns_id)

            demoter = Demoter(admission, [ssd_staging] if ssd_staging is not None else [],
                              holds)
            if ssd_staging is not None:  # the queue's writes are what roll the SSD's log
                ssd_staging.after_batch = stack.write_back_dropped
            stack.demoter = demoter
            eviction = resolve_eviction_policy(d.eviction, has_lower_tier=bool(stack.tiers))
            stack.front = DramTier(d.capacity, d.slab_size, eviction, d.shm_path,
                                   demote=demoter, put_wait_s=d.put_wait_s,
                                   prefault=d.prefault, retention=retention,
                                   quotas=quotas)
            stack.tiers.insert(0, stack.front)
    except BaseException:
        stack.close()
        raise
    return stack
