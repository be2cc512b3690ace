"""Policies decide; the tiers move bytes. Each policy is a small object chosen by config name."""

from kvpool.policy.adaptive import AdaptivePrefixS3FIFOPolicy
from kvpool.policy.admission import (
    AdmissionPolicy,
    AlwaysAdmit,
    FrequencyAdmission,
    HitAdmission,
    SecondUseAdmission,
)
from kvpool.policy.arc import ARCPolicy
from kvpool.policy.base import EvictionPolicy
from kvpool.policy.lru import LRUPolicy
from kvpool.policy.prefix import PrefixS3FIFOPolicy
from kvpool.policy.s3fifo import S3FIFOPolicy
from kvpool.policy.segments import FifoSegments, SecondChanceSegments, SegmentPolicy

EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy, "s3fifo": S3FIFOPolicy, "prefix": PrefixS3FIFOPolicy,
    "adaptive": AdaptivePrefixS3FIFOPolicy, "arc": ARCPolicy,
}
#: What ``dram.eviction: auto`` stands for, by whether a tier lies below DRAM (an SSD or the
#: cluster): the best measured by ``kvpool plan`` on the Mooncake traces (docs/plan.md). With
#: nothing below, ARC's recency side keeps first reuses; with a tier below that already holds
#: the recent puts, prefix S3-FIFO's frequency-protected main queue complements it.
AUTO_EVICTION = {False: "arc", True: "prefix"}
#: Every dram.eviction name: the policies, and "auto".
EVICTION_NAMES = ("auto", *EVICTION_POLICIES)


def resolve_eviction_policy(name: str, has_lower_tier: bool) -> str:
    """The policy ``name`` stands for: ``auto`` per ``AUTO_EVICTION``, any other name itself
    (an unknown one is refused later, by ``make_eviction_policy``)."""
    return AUTO_EVICTION[has_lower_tier] if name == "auto" else name


#: ssd.admission names (see admission.py).
ADMISSION_POLICIES = ("always", "second_use", "hit", "frequency")
SEGMENT_POLICIES: dict[str, type[SegmentPolicy]] = {
    "fifo": FifoSegments,
    "second_chance": SecondChanceSegments,
}


def make_eviction_policy(name: str) -> EvictionPolicy:
    """Raises ValueError for an unknown policy name."""
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        known = sorted(EVICTION_POLICIES)
        raise ValueError(f"unknown eviction policy {name!r}; known: {known}") from None


def make_admission_policy(name: str, window: int = 65536) -> AdmissionPolicy:
    """Raises ValueError for an unknown policy name."""
    if name == "always":
        return AlwaysAdmit()
    if name == "second_use":
        return SecondUseAdmission(window)
    if name == "hit":
        return HitAdmission()
    if name == "frequency":
        return FrequencyAdmission()
    raise ValueError(f"unknown admission policy {name!r}; known: {list(ADMISSION_POLICIES)}")


def make_segment_policy(name: str) -> SegmentPolicy:
    """Raises ValueError for an unknown policy name."""
    try:
        return SEGMENT_POLICIES[name]()
    except KeyError:
        known = sorted(SEGMENT_POLICIES)
        raise ValueError(f"unknown SSD eviction policy {name!r}; known: {known}") from None


__all__ = [
    "ADMISSION_POLICIES",
    "AUTO_EVICTION",
    "EVICTION_NAMES",
    "ARCPolicy",
    "AdaptivePrefixS3FIFOPolicy",
    "AdmissionPolicy",
    "AlwaysAdmit",
    "EvictionPolicy",
    "FifoSegments",
    "FrequencyAdmission",
    "HitAdmission",
    "LRUPolicy",
    "PrefixS3FIFOPolicy",
    "S3FIFOPolicy",
    "SecondChanceSegments",
    "SecondUseAdmission",
    "SegmentPolicy",
    "make_admission_policy",
    "make_eviction_policy",
    "make_segment_policy",
    "resolve_eviction_policy",
]
