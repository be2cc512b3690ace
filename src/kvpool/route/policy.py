"""Routing policies: which engine gets a request. Small strategy objects shared by the
simulation (``kvpool plan --engines N --routing ...``) and the real router (``kvpool route``),
so the figures the planner prints are those of the code that routes.

Each policy sees one :class:`Candidate` per engine: the request's cached prefix on that
engine, split by the tier that would serve it (the engine's own prefix cache, its host pool,
the shared storage nodes: disjoint, in that order along the prompt), and the engine's load
(requests in flight, and the prompt tokens still to prefill of those that have not yet
returned their first token). :class:`KvPolicy` scores

    score = engine_tokens x w_engine + host_tokens x w_host + storage_tokens x w_storage
            - prefill_weight x (pending_tokens - least pending among the eligible engines)
            - load_tokens x (load - least load among the eligible engines)

and takes the highest (Dynamo's KV router credits cached blocks the same way: device 1.0,
host 0.75, disk 0.25, and counts the prefill tokens queued on each worker as its load). With
weights 1 the first two terms are, up to the tier weights, the tokens the engine must compute
before this request's first token: its queue plus the part of the prompt it does not hold.
An engine whose load exceeds ``overload_factor`` x the mean load
(plus one request, so that an idle fleet is never overloaded) is left out unless every
engine is. Ties (equal scores) go to the least-loaded engine, then rotate, so that requests
with no cached prefix anywhere spread like round robin rather than all landing on engine 0.

No policy raises for an empty prefix or a zero load; ``choose`` raises
:class:`NoEngineError` only when no candidate is alive.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

#: Why a policy chose its engine: the label of ``kvpool_route_decisions_total``.
REASON_PREFIX = "prefix"  # the cached prefix (net of load) decided
REASON_LOAD = "least_loaded"  # no prefix difference: the least-loaded engine
REASON_OVERLOAD = "overload"  # the best-scored engine was overloaded: the next best
REASON_ROUND_ROBIN = "round_robin"
REASON_RANDOM = "random"

#: Cached tokens one more request in flight outweighs (decode load; prefill is counted apart).
DEFAULT_LOAD_TOKENS = 256.0
#: An engine above this x the mean requests in flight (+1) is left out.
DEFAULT_OVERLOAD = 1.5


class NoEngineError(RuntimeError):
    """No engine is alive to take the request."""


@dataclass(frozen=True)
class TierWeights:
    """Credit per cached token, per tier that would serve it (Dynamo's defaults)."""

    engine: float = 1.0
    host: float = 0.75
    storage: float = 0.25

    def __post_init__(self) -> None:
        for name in ("engine", "host", "storage"):
            if not 0.0 <= getattr(self, name) <= 1e6:
                raise ValueError(f"tier weight {name} must be in [0, 1e6], got "
                                 f"{getattr(self, name)}")


@dataclass(frozen=True)
class Candidate:
    """One engine as a policy sees it. The three token counts are disjoint runs of the
    prompt's leading chunks: first those in the engine's cache, then those its host pool
    holds, then those on the storage nodes."""

    index: int
    engine_tokens: int = 0
    host_tokens: int = 0
    storage_tokens: int = 0
    load: float = 0.0  # requests in flight
    pending_tokens: int = 0  # prompt tokens to prefill of requests yet to give a first token
    alive: bool = True

    @property
    def cached_tokens(self) -> int:
        return self.engine_tokens + self.host_tokens + self.storage_tokens


@dataclass(frozen=True)
class Decision:
    index: int
    reason: str
    score: float = 0.0


class RoutingPolicy(Protocol):
    name: str

    #: Whether the policy reads the candidates' cached tokens (the router skips the index
    #: lookups for one that does not).
    uses_prefix: bool

    def choose(self, candidates: Sequence[Candidate]) -> Decision:
        """The engine for one request. Raises NoEngineError if no candidate is alive."""
        ...


def _alive(candidates: Sequence[Candidate]) -> list[Candidate]:
    alive = [c for c in candidates if c.alive]
    if not alive:
        raise NoEngineError("no engine is alive")
    return alive


class RoundRobinPolicy:
    """Each alive engine in turn (a dead one is skipped, its turn given to the next)."""

    name = "round_robin"
    uses_prefix = False

    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: Sequence[Candidate]) -> Decision:
        _alive(candidates)
        n = len(candidates)
        for step in range(n):
            c = candidates[(self._next + step) % n]
            if c.alive:
                self._next = (self._next + step + 1) % n
                return Decision(c.index, REASON_ROUND_ROBIN)
        raise AssertionError("unreachable: _alive found one")


class RandomPolicy:
    """A uniformly random alive engine; seeded, so a replay is deterministic."""

    name = "random"
    uses_prefix = False

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, candidates: Sequence[Candidate]) -> Decision:
        return Decision(self._rng.choice(_alive(candidates)).index, REASON_RANDOM)


class LeastLoadedPolicy:
    """The alive engine with the fewest requests in flight, ties rotating: the router's
    fallback when the index cannot answer in time."""

    name = "least_loaded"
    uses_prefix = False

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[Candidate]) -> Decision:
        alive = _alive(candidates)
        low = min((c.pending_tokens, c.load) for c in alive)
        tied = [c for c in alive if (c.pending_tokens, c.load) == low]
        self._turn += 1
        return Decision(tied[self._turn % len(tied)].index, REASON_LOAD)


class KvPolicy:
    """Cached prefix per tier x weight, minus load (see the module docstring). Raises
    ValueError for a negative ``load_tokens`` or an ``overload_factor`` below 1."""

    name = "kv"
    uses_prefix = True

    def __init__(self, weights: TierWeights | None = None, load_tokens: float = DEFAULT_LOAD_TOKENS,
                 overload_factor: float = DEFAULT_OVERLOAD, prefill_weight: float = 1.0) -> None:
        if not load_tokens >= 0:
            raise ValueError(f"load_tokens must be >= 0, got {load_tokens}")
        if not prefill_weight >= 0:
            raise ValueError(f"prefill_weight must be >= 0, got {prefill_weight}")
        self.prefill_weight = prefill_weight
        if not overload_factor >= 1.0:
            raise ValueError(f"overload_factor must be >= 1, got {overload_factor}")
        self.weights = weights or TierWeights()
        self.load_tokens = load_tokens
        self.overload_factor = overload_factor
        self._turn = 0

    def credit(self, c: Candidate) -> float:
        w = self.weights
        return c.engine_tokens * w.engine + c.host_tokens * w.host + c.storage_tokens * w.storage

    def choose(self, candidates: Sequence[Candidate]) -> Decision:
        alive = _alive(candidates)
        limit = self.overload_factor * sum(c.load for c in alive) / len(alive) + 1.0
        eligible = [c for c in alive if c.load <= limit] or alive
        low = min(c.load for c in eligible)
        queued = min(c.pending_tokens for c in eligible)
        scores = [self.credit(c) - self.prefill_weight * (c.pending_tokens - queued)
                  - self.load_tokens * (c.load - low) for c in eligible]
        best = max(scores)
        tied = [c for c, s in zip(eligible, scores, strict=True) if s >= best - 1e-9]
        least = min((c.pending_tokens, c.load) for c in tied)
        tied = [c for c in tied if (c.pending_tokens, c.load) == least]
        self._turn += 1
        pick = tied[self._turn % len(tied)]
        credits = {self.credit(c) for c in alive}
        if len(credits) == 1:
            reason = REASON_LOAD
        elif max(self.credit(c) for c in alive) > self.credit(pick) and any(
                c.load > limit for c in alive if self.credit(c) > self.credit(pick)):
            reason = REASON_OVERLOAD
        else:
            reason = REASON_PREFIX
        return Decision(pick.index, reason, best)


#: The policies by ``--routing`` name.
POLICY_NAMES = ("kv", "round_robin", "random", "least_loaded")


def make_policy(name: str, weights: TierWeights | None = None,
                load_tokens: float = DEFAULT_LOAD_TOKENS, overload_factor: float = DEFAULT_OVERLOAD,
                prefill_weight: float = 1.0, seed: int = 0) -> RoutingPolicy:
    """Raises ValueError for an unknown name or a bad knob."""
    if name == "kv":
        return KvPolicy(weights, load_tokens, overload_factor, prefill_weight)
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "random":
        return RandomPolicy(seed)
    if name == "least_loaded":
        return LeastLoadedPolicy()
    raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICY_NAMES)}")
