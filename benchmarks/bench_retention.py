"""Cost of retention on the put path, for two source trees side by side.

``python benchmarks/bench_retention.py --before /work/main/src --after src`` churns
``--batches`` put_many calls of 16 x 4 KiB chunks through a 4 MiB DRAM-only pool (LRU, so
every put past the first 64 batches evicts) and prints the median seconds per 1000 chunks
over ``--repeats`` pools, per tree, plus ``--after`` with every 10th batch saved HIGH (DRAM
ends up full of HIGH chunks: the worst case of the retention wrapper). Each run is its own
child process with only that tree on its path; the runs repeat ``--rounds`` times, in
alternating order, so a loaded machine slows both alike. Ratios are to the ``--before``
median of the same round.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

CHILD = r"""
import statistics, sys, tempfile, time
import numpy as np
from kvpool import KVPool
from kvpool.config import config_from_dict
from kvpool.keys import KVLayout, Namespace
high, batches, repeats = sys.argv[1] == "high", int(sys.argv[2]), int(sys.argv[3])
ns = Namespace("bench", KVLayout("uint8", 1, 1, 4096, 1, kv_factor=1))
data = [np.zeros(4096, np.uint8)] * 16
if high:
    from kvpool.retention import Priority, Retention
    hi = Retention(Priority.HIGH)
times = []
for rep in range(repeats):
    with tempfile.TemporaryDirectory() as d:
        pool = KVPool(config_from_dict({"cache_dir": d, "ssd": {"enabled": False}, "dram": {
            "capacity": "4MiB", "slab_size": "1MiB", "eviction": "lru"}}))
        pool.register_namespace(ns)
        start = time.perf_counter()
        for b in range(batches):
            keys = [(rep << 40 | b << 8 | i).to_bytes(16, "little") for i in range(16)]
            if high and b % 10 == 0:
                pool.put_many(ns, keys, data, hi)
            else:
                pool.put_many(ns, keys, data)
        times.append((time.perf_counter() - start) * 1000 / (16 * batches))
        pool.close()
print(statistics.median(times))
"""


def run(src: str, mode: str, batches: int, repeats: int) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(batches), str(repeats)],
                         env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True)
    return float(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="source tree of the reference")
    parser.add_argument("--after", required=True, help="source tree with retention")
    parser.add_argument("--batches", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    plain, high = [], []
    for round_ in range(args.rounds):  # the order alternates: neither side always goes first
        if round_ % 2:
            worst = run(args.after, "high", args.batches, args.repeats)
            after = run(args.after, "plain", args.batches, args.repeats)
            ref = run(args.before, "plain", args.batches, args.repeats)
        else:
            ref = run(args.before, "plain", args.batches, args.repeats)
            after = run(args.after, "plain", args.batches, args.repeats)
            worst = run(args.after, "high", args.batches, args.repeats)
        plain.append(after / ref)
        high.append(worst / ref)
        print(f"s/1000 chunks: before {ref:.4f}  after {after:.4f}  after, 10% HIGH "
              f"{worst:.4f}")
    print(f"median ratio to before (> 1 = slower): no retention asked "
          f"{statistics.median(plain):.2f}x, 10% HIGH {statistics.median(high):.2f}x")


if __name__ == "__main__":
    main()
