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

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.config import Config
from kvpool.keys import Namespace
from kvpool.policy import AdmissionPolicy, make_admission_policy
from kvpool.ssd.engine import SsdEngine
from kvpool.tiers.base import Tier
from kvpool.tiers.dram import DramTier
from kvpool.tiers.remote import RemoteTier
from kvpool.tiers.ssd import SsdTier
from kvpool.tiers.staging import WriteBehind


class Demoter:
    """The DRAM tier's demotion sink: victims no lower tier holds yet are offered to
    ``targets`` (staging queues, which never block), if ``admission`` admits them."""

    def __init__(self, admission: AdmissionPolicy, targets: Sequence[Tier]) -> None:
        self._admission = admission
        self._targets = list(targets)

    def demote(self, key: bytes, ns: Namespace, payload: memoryview, hits: int,
               on_lower: bool) -> None:
        if on_lower or not self._targets or not self._admission.admit(key, hits):
            return
        for target in self._targets:
            target.put_many([(key, ns, payload)])


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

    def lower(self) -> list[Tier]:
        return [t for t in self.tiers if t is not self.front]

    def close(self) -> None:
        """Close in read order: a staging queue drains into its sink before the sink closes.
        Every tier is closed even if one fails; the first error is raised after."""
        error: BaseException | None = None
        for tier in self.tiers:
            try:
                tier.close()
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error


def build_tiers(cfg: Config, remote: bool = True) -> TierStack:
    """The tiers ``cfg`` asks for. Raises what the tiers raise when they cannot be opened
    (OSError, ValueError, CacheDirLockedError, InsufficientSpaceError, ...), after closing the
    ones already open."""
    stack = TierStack([], None)
    ssd_staging: WriteBehind | None = None
    try:
        if cfg.ssd.enabled:
            ssd = SsdTier(SsdEngine.from_config(cfg))
            ssd_staging = WriteBehind(ssd.engine, cfg.pool.write_behind_bytes,
                                      cfg.pool.write_behind_batch)
            stack.tiers[:0] = [ssd_staging, ssd]
            if cfg.pool.ssd_write == "through" or cfg.dram.capacity == 0:
                durable = cfg.ssd.durability == "durable"
                stack.through.append(ssd if durable else ssd_staging)
                stack.ack = ssd if durable else None
        if remote and cfg.cluster.enabled:
            nodes = RemoteTier(cfg.cluster)
            stack.tiers.append(nodes)
            staging = WriteBehind(nodes.client, cfg.cluster.write_behind_bytes,
                                  cfg.pool.write_behind_batch, label="cluster",
                                  stats_key=("remote", "write_behind"))
            stack.tiers.insert(1 if ssd_staging is not None else 0, staging)
            stack.through.append(staging)
        if cfg.dram.capacity > 0:
            d = cfg.dram
            admission = make_admission_policy(cfg.ssd.admission, cfg.ssd.second_use_window)
            demoter = Demoter(admission, [ssd_staging] if ssd_staging is not None else [])
            stack.front = DramTier(d.capacity, d.slab_size, d.eviction, d.shm_path,
                                   demote=demoter, put_wait_s=d.put_wait_s,
                                   prefault=d.prefault)
            stack.tiers.insert(0, stack.front)
    except BaseException:
        stack.close()
        raise
    return stack
