"""The tier interface: what every level of a KVPool (DRAM, write-behind staging, SSD, storage
nodes) offers, so the pool loops over an ordered list of tiers instead of wiring each by hand.

A tier holds immutable chunks filed by (key, namespace). Every method is thread-safe. The
failure contract is the pool's: a miss, a fault of the media or a dead peer is a value (False,
0), never an exception; misuse (a wrong buffer size, a closed tier) raises.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Any, Protocol

from kvpool.keys import Namespace

#: (key, namespace, payload) as tiers store it.
Item = tuple[bytes, Namespace, memoryview]


class Tier(Protocol):
    #: Names the pool's per-tier counters (``<name>_hits``).
    name: str
    #: The ``tier`` label of its metrics (kvpool/metrics/catalogue.py TIERS).
    label: str
    #: Where ``stats()`` goes in ``KVPool.stats()``, e.g. ("ssd",) or ("remote", "client").
    stats_key: tuple[str, ...]

    def register_namespace(self, ns: Namespace) -> None:
        """Accept a namespace: raises ValueError if its chunks can never fit this tier,
        AuthError if storage nodes refuse it."""
        ...

    def contains_many(self, keys: Sequence[bytes], namespace_id: bytes) -> list[bool]:
        """Per key: does this tier hold it (under ``namespace_id``)? Only what the tier knows
        in this process, without IO or network: cheap enough for every save and lookup."""
        ...

    def lookup(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        """Length of the leading run of ``keys`` this tier holds; a remote tier asks its
        nodes (one batched request per node)."""
        ...

    def get_many_into(self, ns: Namespace, keys: Sequence[bytes],
                      outs: Sequence[memoryview]) -> list[bool]:
        """Copy each chunk into its ``out`` (exactly the chunk size); False per miss,
        including a chunk that fails verification."""
        ...

    def put_many(self, items: Sequence[Item]) -> list[bool]:
        """Store chunks; per chunk True if this tier holds it now (or has it queued, for a
        staging tier), False if it was dropped (full, failing media: counted)."""
        ...

    def delete(self, key: bytes, ns: Namespace) -> bool:
        """Remove a chunk; True if this tier held it."""
        ...

    def invalidate(self, namespace_id: bytes, ns: Namespace | None) -> int:
        """Drop every chunk of a namespace (``ns`` is None where only the id is known);
        returns how many copies this tier dropped."""
        ...

    def touch_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Count the chunks as just read (eviction recency) without moving bytes; never
        waits. Per key: True if this tier held it and counted it."""
        ...

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until what this tier queued reached the tier below; False on timeout."""
        ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None:
        """Release the tier (a staging tier writes out what it holds first). Idempotent."""
        ...


class DemotionSink(Protocol):
    """Where a tier sends the chunks it evicts (the pool gives DRAM one: see Demoter)."""

    def demote(self, key: bytes, ns: Namespace, payload: memoryview, hits: int,
               on_lower: bool) -> None:
        """Called for every evicted chunk, outside the evicting tier's lock; ``payload`` is
        valid only during the call. ``hits``: reads while resident; ``on_lower``: a lower
        tier already holds it."""
        ...


def leading_run(flags: Sequence[bool]) -> int:
    """Index of the first False (len(flags) if none)."""
    try:
        return flags.index(False)  # in C: a 512-key probe is one call, not a loop
    except ValueError:
        return len(flags)


def local_lookup(contains_many: Callable[[Sequence[bytes], bytes], list[bool]],
                 keys: Sequence[bytes], namespace_id: bytes) -> int:
    """``Tier.lookup`` of a tier that knows its contents: the first key alone first, since a
    pool asks its lower tiers about keys its faster ones lack, so the answer is mostly 0."""
    if not keys or not contains_many(keys[:1], namespace_id)[0]:
        return 0
    return leading_run(contains_many(keys, namespace_id))


_HIT_COUNTS: dict[str, tuple[str, str, str]] = {}


def hit_counts(tier_name: str) -> tuple[str, str, str]:
    """The pool's counter names for reads a tier served: hits, bytes, tokens."""
    names = _HIT_COUNTS.get(tier_name)
    if names is None:
        names = _HIT_COUNTS[tier_name] = (f"{tier_name}_hits", f"{tier_name}_hit_bytes",
                                          f"{tier_name}_hit_tokens")
    return names


def read_tiers(tiers: Sequence[Tier], ns: Namespace, keys: Sequence[bytes],
               outs: Sequence[memoryview], counts: dict[str, int] | None,
               timings: list[float] | None = None) -> list[int]:
    """Read each key from the first tier (in order) that has it. Returns, per key, the index
    of the tier that served it, or -1 for a miss. Adds the hits, bytes and tokens each tier
    served to ``counts`` (``hit_counts`` names them; None: not counted). With ``timings``,
    appends the seconds of every tier asked: tiers are asked in order from the first, so
    entry i is tier i's."""
    served = [-1] * len(keys)
    pending = list(range(len(keys)))
    for index, tier in enumerate(tiers):
        if not pending:
            break
        started = perf_counter() if timings is not None else 0.0
        got = tier.get_many_into(ns, [keys[i] for i in pending], [outs[i] for i in pending])
        if timings is not None:
            timings.append(perf_counter() - started)
        still = []
        for i, hit in zip(pending, got, strict=True):
            if hit:
                served[i] = index
            else:
                still.append(i)
        hits = len(pending) - len(still)
        if hits and counts is not None:
            chunks, nbytes, tokens = hit_counts(tier.name)
            counts[chunks] = counts.get(chunks, 0) + hits
            counts[nbytes] = counts.get(nbytes, 0) + hits * ns.chunk_bytes
            counts[tokens] = counts.get(tokens, 0) + hits * ns.layout.chunk_tokens
        pending = still
    return served
