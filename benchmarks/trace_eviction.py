"""Chunk hit rate of each DRAM eviction policy on a request trace, beside Belady's.

Replays a trace of the shared/traces format (one JSON object a line with ``hash_ids``)
through a real DRAM-only ``KVPool`` with tiny chunks, one chunk per hash id: per request a
lookup, a get of the hit prefix, a put of the rest (one put_many, in prefix order). The DRAM
tier holds a fraction of the trace's distinct chunks. Belady is the offline optimum computed on
the same sequence: on a miss with the cache full, evict the chunk whose next use is furthest
(deepest first on a tie), no bypass.

    python benchmarks/trace_eviction.py \
        --trace ../shared/traces/synthetic_trace.jsonl

Raises ValueError naming the line for a malformed trace line. About 2 s per policy and
capacity for the 122k-reference synthetic trace on one core.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

# This checkout's kvpool, even where another one is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvpool import KVPool
from kvpool.config import config_from_dict
from kvpool.keys import KVLayout, Namespace
from kvpool.policy import EVICTION_POLICIES

CHUNK = 4096  # the smallest DRAM slot: capacity in slots is exact


def load_trace(path: Path) -> list[list[int]]:
    """Each request's hash ids; ValueError naming the line for a malformed one."""
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            ids = json.loads(line)["hash_ids"]
            if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
                raise TypeError("hash_ids is not a list of integers")
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: malformed trace line ({exc})") from None
        requests.append(ids)
    return requests


def pool_hit_rate(requests: Sequence[Sequence[int]], capacity: int, policy: str,
                  scratch: Path) -> float:
    """Chunk hit rate of a DRAM-only KVPool of ``capacity`` chunks evicting by ``policy``."""
    config = config_from_dict({
        "cache_dir": str(scratch), "ssd": {"enabled": False},
        "dram": {"capacity": capacity * CHUNK, "slab_size": CHUNK, "eviction": policy,
                 "prefault": "none"},
        "metrics": {"enabled": False},
    })
    ns = Namespace("trace", KVLayout("uint8", 1, 1, CHUNK, 1, kv_factor=1))
    payload = np.zeros(CHUNK, np.uint8)
    outs = [np.empty(CHUNK, np.uint8) for _ in range(max(map(len, requests), default=0))]
    hits = total = 0
    with KVPool(config, remote=False, serve_metrics=False) as pool:
        pool.register_namespace(ns)
        for ids in requests:
            keys = [i.to_bytes(16, "little") for i in ids]
            n = pool.lookup(ns, keys)
            if n:
                pool.get_many_into(ns, keys[:n], outs[:n])
            if n < len(keys):
                pool.put_many(ns, keys[n:], [payload] * (len(keys) - n))
            hits += n
            total += len(keys)
    return hits / max(total, 1)


def belady_hit_rate(requests: Sequence[Sequence[int]], capacity: int) -> float:
    """Offline optimum on the same sequence: evict the chunk used again furthest ahead."""
    never = 1 << 62
    flat = [k for ids in requests for k in ids]
    next_use = [never] * len(flat)
    seen: dict[int, int] = {}
    for i in range(len(flat) - 1, -1, -1):
        next_use[i] = seen.get(flat[i], never)
        seen[flat[i]] = i
    cached: dict[int, int] = {}  # key -> its next use
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, key), stale entries skipped
    hits = total = position = 0
    for ids in requests:
        n = 0
        while n < len(ids) and ids[n] in cached:
            n += 1
        hits += n
        total += len(ids)
        for depth, key in enumerate(ids):
            use = next_use[position]
            position += 1
            if key not in cached:
                while len(cached) >= capacity:
                    far, _, victim = heapq.heappop(heap)
                    if cached.get(victim) == -far:
                        del cached[victim]
            cached[key] = use
            heapq.heappush(heap, (-use, -depth, key))
    return hits / max(total, 1)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.10, 0.25],
                        help="DRAM capacity as fractions of the distinct chunks")
    parser.add_argument("--policies", nargs="+", default=sorted(EVICTION_POLICIES),
                        choices=sorted(EVICTION_POLICIES))
    args = parser.parse_args(argv)
    requests = load_trace(args.trace)
    distinct = len({k for ids in requests for k in ids})
    print(f"{args.trace.name}: {len(requests)} requests, {sum(map(len, requests))} chunk "
          f"references, {distinct} distinct chunks")
    with tempfile.TemporaryDirectory() as scratch:
        for fraction in args.fractions:
            capacity = max(1, int(distinct * fraction))
            rates = {p: pool_hit_rate(requests, capacity, p, Path(scratch))
                     for p in args.policies}
            rates["belady"] = belady_hit_rate(requests, capacity)
            print(f"{fraction:.0%} ({capacity} chunks): "
                  + "  ".join(f"{name} {rate:.3f}" for name, rate in rates.items()), flush=True)


if __name__ == "__main__":
    main()
