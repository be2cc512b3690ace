"""The DRAM admission/eviction ideas of issue 25, replayed through ``kvpool plan``'s models.

Each idea is a small ``EvictionPolicy`` registered under a name for this run only (it is not
offered by the pool); every one is replayed DRAM only at 5/10/25/50% of a trace's distinct
chunks with ``kvpool.plan.replay`` (the calls KVPool makes on its policy, docs/plan.md),
beside ``lru``, ``arc`` (the default with no SSD) and the bound the issue measures ideas
against: LRU with an oracle that stores only chunks referenced again later (a chunk that is
not goes to the evict end, so it holds a slot until the next eviction). Prints one line per
trace and idea: the chunk hit rate at each size, and at 10% its ratio to Belady.

    python benchmarks/policy_ideas.py --trace ../shared/traces/conversation_head.jsonl \
        ../shared/traces/synthetic_trace.jsonl [--only NAME ...]

About 3-10 s per idea and trace on a loaded 2-core VM. The figures are in docs/plan.md
("Ideas measured and dropped"); none of these ideas was kept.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

# This checkout's kvpool, even where another one is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np

from kvpool.plan.belady import belady
from kvpool.plan.dram import DramModel
from kvpool.plan.replay import TierConfig, replay, replay_request
from kvpool.plan.trace import Trace, read_trace
from kvpool.policy import EVICTION_POLICIES, ARCPolicy, EvictionPolicy, LRUPolicy
from kvpool.policy.base import Key
from kvpool.policy.sketch import FrequencySketch

SIZES = (0.05, 0.10, 0.25, 0.50)
CHUNK_BYTES = 512 * 46080  # the cpu preset's chunk; DRAM only, so it only sets slot sizes


class WindowTinyLFU(EvictionPolicy):
    """W-TinyLFU (Einziger et al., TOS 2017; Caffeine): new keys enter a window LRU of
    ``window`` x the residents; the window's LRU key (the candidate) enters the main SLRU
    (probation, then protected on a hit, protected <= 80% of main) only if a count-min sketch
    with a doorkeeper estimates it more frequent than main's victim; otherwise it is the one
    evicted. ``chain``: the decision is taken once per put batch (a request's new tail),
    from its first key's frequency, and applies to every key of the batch. ``adapt``: the
    window share moves ARC-style, up on a re-insert of a key the window evicted, down on one
    main evicted, within [1%, 99%]."""

    def __init__(self, window: float = 0.01, chain: bool = False, adapt: bool = False) -> None:
        self.window_fraction = window
        self._chain, self._adapt = chain, adapt
        self._window: OrderedDict[Key, None] = OrderedDict()
        self._probation: OrderedDict[Key, None] = OrderedDict()
        self._protected: OrderedDict[Key, None] = OrderedDict()
        self._sketch = FrequencySketch(1024)
        self._door: set[Key] = set()
        self._counted = 0
        self._head: dict[Key, Key] = {}  # window key -> the first key of its put batch
        self._decision: dict[Key, bool] = {}
        self._window_ghost: OrderedDict[Key, None] = OrderedDict()
        self._main_ghost: OrderedDict[Key, None] = OrderedDict()

    def _count(self, key: Key) -> None:
        self._sketch.ensure_capacity(max(16, 1 << max(1, len(self)).bit_length()))
        if key not in self._door:
            self._door.add(key)
        else:
            self._sketch.increment(key)
        self._counted += 1
        if self._counted >= 10 * self._sketch.width:  # the sketch halves: reset the door too
            self._door.clear()
            self._counted = 0

    def _frequency(self, key: Key) -> int:
        return self._sketch.estimate(key) + (key in self._door)

    def insert(self, key: Key) -> None:
        if key in self:
            self.touch(key)
            return
        self._count(key)
        if self._adapt:
            step = 1.0 / max(1, len(self))
            if self._window_ghost.pop(key, 0) is None:
                self.window_fraction = min(0.99, self.window_fraction + step)
            elif self._main_ghost.pop(key, 0) is None:
                self.window_fraction = max(0.01, self.window_fraction - step)
        self._window[key] = None

    def touch(self, key: Key) -> None:
        self._count(key)
        if key in self._window:
            self._window.move_to_end(key)
        elif key in self._probation:
            del self._probation[key]
            self._protected[key] = None
        elif key in self._protected:
            self._protected.move_to_end(key)

    def remove(self, key: Key) -> None:
        for queue in (self._window, self._probation, self._protected):
            queue.pop(key, None)
        self._head.pop(key, None)

    def put_batch(self, keys: Sequence[Key]) -> None:
        new = [k for k in keys if k in self._window]
        if self._chain and new:
            for k in new:
                self._head[k] = new[0]

    def _remember(self, ghost: OrderedDict[Key, None], key: Key) -> Key:
        ghost[key] = None
        while len(ghost) > max(64, 2 * len(self)):
            ghost.popitem(last=False)
        return key

    def _admit(self, candidate: Key, victim: Key) -> bool:
        head = self._head.pop(candidate, None)
        if head is None:
            return self._frequency(candidate) > self._frequency(victim)
        if head not in self._decision:
            self._decision[head] = self._frequency(head) > self._frequency(victim)
        return self._decision[head]

    def evict(self, evictable: Callable[[Key], bool]) -> Key | None:
        size = len(self)
        window = max(1, int(self.window_fraction * size))
        main = size - window
        while len(self._protected) > 0.8 * main:
            self._probation[self._protected.popitem(last=False)[0]] = None
        while len(self._window) > window + 1:  # the window shrank: its oldest go to main
            key = self._window.popitem(last=False)[0]
            self._head.pop(key, None)
            self._probation[key] = None
        queue = self._probation or self._protected
        if len(self._window) > window and queue:
            candidate, victim = next(iter(self._window)), next(iter(queue))
            del self._window[candidate]
            if self._admit(candidate, victim):
                del queue[victim]
                self._probation[candidate] = None
                return self._remember(self._main_ghost, victim)
            return self._remember(self._window_ghost, candidate)
        if queue:
            return self._remember(self._main_ghost, queue.popitem(last=False)[0])
        if self._window:
            key = self._window.popitem(last=False)[0]
            self._head.pop(key, None)
            return self._remember(self._window_ghost, key)
        return None

    def __len__(self) -> int:
        return len(self._window) + len(self._probation) + len(self._protected)

    def __contains__(self, key: object) -> bool:
        return key in self._window or key in self._probation or key in self._protected


class ChainGhostARC(ARCPolicy):
    """ARC that admits a whole put batch to T2 (the reused side) when any of its keys was
    a ghost: a conversation seen again after its chunks were evicted sends its new turn's
    chunks to T2 too, not only the re-put ones."""

    def __init__(self) -> None:
        super().__init__()
        self._ghost_seen = False

    def insert(self, key: Key) -> None:
        if key not in self and (key in self._b1 or key in self._b2):
            self._ghost_seen = True
        super().insert(key)

    def put_batch(self, keys: Sequence[Key]) -> None:
        if self._ghost_seen:
            for k in keys:
                if k in self._t1:
                    del self._t1[k]
                    self._t2[k] = None
        self._ghost_seen = False


class HalfStartARC(ARCPolicy):
    """ARC whose target ``p`` for T1 starts at half the capacity (at the first eviction)
    instead of 0."""

    def __init__(self) -> None:
        super().__init__()
        self._started = False

    def evict(self, evictable: Callable[[Key], bool]) -> Key | None:
        if not self._started:
            self._started, self.p = True, len(self) / 2
        return super().evict(evictable)


class ShadowAgedARC(ARCPolicy):
    """ARC that evicts T2's least recent key instead when it has been idle ``k`` times
    longer than T1's least recent key (k = 1 is LRU over both lists, a large k is ARC).
    ``k`` follows two shadows of the same capacity (keys only), an LRU and an ARC: x(1 +
    ``eta``) on a reference only the ARC shadow holds, / (1 + ``eta``) on one only the LRU
    shadow holds, within [1, 64]. Memory: three times ARC's bookkeeping."""

    def __init__(self, k: float = 16.0, eta: float = 0.01) -> None:
        super().__init__()
        self.k, self._eta = k, eta
        self._tick = 0
        self._last: dict[Key, int] = {}
        self._lru: OrderedDict[Key, None] = OrderedDict()
        self._arc = ARCPolicy()
        self._capacity = 0

    def _reference(self, key: Key) -> None:
        cap = self._capacity
        lru_hit, arc_hit = key in self._lru, key in self._arc
        if cap and arc_hit != lru_hit:
            self.k = min(64.0, self.k * (1 + self._eta)) if arc_hit \
                else max(1.0, self.k / (1 + self._eta))
        self._lru[key] = None
        self._lru.move_to_end(key)
        while cap and len(self._lru) > cap:
            self._lru.popitem(last=False)
        if arc_hit:
            self._arc.touch(key)
        else:
            if cap and len(self._arc) >= cap:
                self._arc.evict(lambda _: True)
            self._arc.insert(key)
        self._tick += 1

    def insert(self, key: Key) -> None:
        self._reference(key)
        super().insert(key)
        self._last[key] = self._tick

    def touch(self, key: Key) -> None:
        if key in self:
            self._reference(key)
            self._last[key] = self._tick
        super().touch(key)

    def remove(self, key: Key) -> None:
        super().remove(key)
        self._last.pop(key, None)

    def evict(self, evictable: Callable[[Key], bool]) -> Key | None:
        self._capacity = max(self._capacity, len(self))
        if self._t1 and self._t2:
            old1, old2 = next(iter(self._t1)), next(iter(self._t2))
            idle1, idle2 = self._tick - self._last[old1], self._tick - self._last[old2]
            if idle2 > self.k * idle1 and evictable(old2):
                del self._t2[old2]
                self._remember(self._b2, old2)
                del self._last[old2]
                return old2
        victim = super().evict(evictable)
        self._last.pop(victim, None)
        return victim


class OracleLRU(LRUPolicy):
    """LRU that stores only chunks referenced again later (the bound of issue 25): each
    insert or touch is one reference of the key (true of a DRAM-only replay), counted down
    from the trace's totals; a key with none left goes to the evict end."""

    def __init__(self, remaining: Counter[int]) -> None:
        super().__init__()
        self._remaining = remaining

    def insert(self, key: Key) -> None:
        self._remaining[key] -= 1  # type: ignore[index]
        super().insert(key)
        if self._remaining[key] <= 0:  # type: ignore[index]
            self._order.move_to_end(key, last=False)

    def touch(self, key: Key) -> None:
        if key in self:
            self._remaining[key] -= 1  # type: ignore[index]
        super().touch(key)


IDEAS: dict[str, Callable[[], EvictionPolicy]] = {
    "wtinylfu-1": lambda: WindowTinyLFU(0.01),
    "wtinylfu-20": lambda: WindowTinyLFU(0.20),
    "wtinylfu-50": lambda: WindowTinyLFU(0.50),
    "wtinylfu-1-chain": lambda: WindowTinyLFU(0.01, chain=True),
    "wtinylfu-adaptive": lambda: WindowTinyLFU(0.10, adapt=True),
    "wtinylfu-adaptive-chain": lambda: WindowTinyLFU(0.10, chain=True, adapt=True),
    "arc-chain-ghost": ChainGhostARC,
    "arc-half-start": HalfStartARC,
    "arc-shadow-aged": ShadowAgedARC,
    "arc-shadow-aged-k4": lambda: ShadowAgedARC(k=4.0),
    "arc-shadow-aged-fast": lambda: ShadowAgedARC(eta=0.02),
}


def hit_rates(trace: Trace, name: str) -> list[float]:
    """Chunk hit rate of the registered policy ``name`` at each of SIZES, DRAM only."""
    return [float(replay(trace, TierConfig(name, int(f * trace.distinct)), CHUNK_BYTES)
                  .hits.sum()) / trace.references for f in SIZES]


def first_reuse_gaps(trace: Trace) -> str:
    """Where first reuses fall: new chunks put between a chunk's first put and its first
    reuse (percentiles), the share of first reuses a plain LRU of each size can catch, and
    the share of new chunks whose request shares only its first block with earlier ones
    (a prefix that says nothing of the conversation)."""
    first: dict[int, int] = {}
    reused: set[int] = set()
    gaps: list[int] = []
    keys, starts = trace.keys.tolist(), trace.starts.tolist()
    shallow = 0
    for j in range(trace.requests):
        request = keys[starts[j]:starts[j + 1]]
        depth = next((i for i, k in enumerate(request) if k not in first), len(request))
        if depth <= 1:
            shallow += len(request) - depth
        for key in request:
            if key not in first:
                first[key] = len(first)
            elif key not in reused:
                reused.add(key)
                gaps.append(len(first) - first[key])
    g = np.asarray(gaps)
    pct = " ".join(f"p{q} {np.percentile(g, q):,.0f}" for q in (10, 25, 50, 75, 90))
    within = " ".join(f"{f:.0%} {np.mean(g < f * trace.distinct):.2f}" for f in SIZES)
    return (f"  {len(gaps):,} of {len(first):,} chunks reused; first-reuse gap in new chunks "
            f"{pct}; share within DRAM {within}; new chunks under the first block only "
            f"{shallow / len(first):.2f}")


def reuse_split(trace: Trace, name: str, fraction: float = 0.10) -> str:
    """Hits of the registered policy ``name`` at a DRAM of ``fraction`` of the distinct
    chunks, split into first reuses (a chunk's second reference) and later ones."""
    dram = DramModel(name, int(fraction * trace.distinct))
    keys, starts = trace.keys.tolist(), trace.starts.tolist()
    seen: Counter[int] = Counter()
    first = later = 0
    for j in range(trace.requests):
        request = keys[starts[j]:starts[j + 1]]
        n, _ = replay_request(dram, None, request, through=False, promote=False)
        hit_first = sum(seen[k] == 1 for k in request[:n])
        first, later = first + hit_first, later + n - hit_first
        seen.update(request)
    firsts = sum(c > 1 for c in seen.values())
    return (f"  {name} at {fraction:.0%}: first reuses hit {first:,} of {firsts:,}, later "
            f"reuses {later:,} of {trace.references - len(seen) - firsts:,}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", nargs="+", required=True, type=Path)
    ap.add_argument("--only", nargs="*", default=None, help="ideas to run (default: all)")
    args = ap.parse_args(argv)
    names = ["lru", "arc", "oracle", *(args.only if args.only is not None else IDEAS)]
    for path in args.trace:
        trace = read_trace(path)
        best = float(belady(trace, int(0.10 * trace.distinct)).hits.sum()) / trace.references
        print(f"{path.name}: DRAM {', '.join(f'{f:.0%}' for f in SIZES)}; Belady 10% "
              f"{best:.4f}", flush=True)
        print(first_reuse_gaps(trace), flush=True)
        for name in ("lru", "arc"):
            print(reuse_split(trace, name), flush=True)
        for name in names:
            borrowed = name not in EVICTION_POLICIES
            if name == "oracle":
                counts = Counter(trace.keys.tolist())
                EVICTION_POLICIES[name] = lambda c=counts: OracleLRU(Counter(c))  # type: ignore
            elif borrowed:
                EVICTION_POLICIES[name] = IDEAS[name]  # type: ignore[assignment]
            started = time.perf_counter()
            rates = hit_rates(trace, name)
            if borrowed:
                del EVICTION_POLICIES[name]
            print(f"  {name:>24}: {' '.join(f'{r:.4f}' for r in rates)}  "
                  f"({rates[1] / best:.3f}x Belady at 10%; {time.perf_counter() - started:.0f} s)",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
