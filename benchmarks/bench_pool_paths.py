"""The pool's own paths, for two source trees side by side (issue 10: the tier list must not cost
anything): a load of SSD-resident chunks through ``KVPool.get_many_into``, and saves into a
full DRAM tier (every put evicts and demotes) through ``KVPool.put_many``.

``python benchmarks/bench_pool_paths.py --before <old src> --after src`` runs each tree in its
own child process (only that tree on its path), alternating, ``--rounds`` times. Every figure is
printed beside its reference measured in the same child: the SSD engine's own batched read of
the same number of chunks (``SsdEngine.get_many_into`` on a second engine) for loads, and
``np.copyto`` of the same bytes for saves. Median and p99 over all batches of all rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time
import numpy as np
from kvpool.config import config_from_dict
from kvpool.keys import KVLayout, Namespace
from kvpool.pool import KVPool
from kvpool.ssd.engine import SsdEngine
work = sys.argv[1]
chunk, n, batch, loads = (int(a) for a in sys.argv[2:6])
ns = Namespace("bench", KVLayout("uint8", 1, 1, chunk, 1, kv_factor=1))
rng = np.random.default_rng(7)
datas = [rng.integers(0, 256, chunk, dtype=np.uint8) for _ in range(64)]
keys = [i.to_bytes(8, "little") * 2 for i in range(n)]
dram = max(8 << 20, (n // 8) * chunk)  # an eighth of the chunks fit in DRAM
seg = 32 << 20
cfg = config_from_dict({"cache_dir": work + "/pool",
                        "dram": {"capacity": dram, "slab_size": 4 << 20},
                        "ssd": {"capacity": (n * (chunk + 4096) * 2 // seg + 3) * seg,
                                "segment_size": seg},
                        "pool": {"write_behind_bytes": 512 << 20}})
out = {"save": [], "save_ref": [], "load": [], "load_ref": []}
with KVPool(cfg) as pool:
    pool.register_namespace(ns)
    sink = np.empty((batch, chunk), np.uint8)
    for lo in range(0, n, batch):
        part = keys[lo:lo + batch]
        t0 = time.perf_counter()
        assert pool.put_many(ns, part, [datas[i % 64] for i in range(len(part))]) == len(part)
        t1 = time.perf_counter()
        for j in range(len(part)):
            np.copyto(sink[j], datas[j % 64])
        t2 = time.perf_counter()
        if lo >= dram // chunk:  # DRAM is full: every put evicts and demotes
            out["save"].append(t1 - t0)
            out["save_ref"].append(t2 - t1)
    assert pool.flush(60)
    ref = SsdEngine(work + "/ref", cfg.ssd.capacity, cfg.ssd.segment_size, "cache")
    ref.put_many([(k, ns, datas[i % 64]) for i, k in enumerate(keys[:batch * 4])])
    outs = [np.empty(chunk, np.uint8) for _ in range(batch)]
    for _ in range(loads):
        picked = []
        pool.flush(10)  # the previous load's promotions: in neither this one's nor the ref's time
        for i in rng.permutation(n):  # chunks only the SSD holds now
            view = pool.pin_many(ns, [keys[i]])[0]
            if view is None:
                picked.append(keys[i])
                if len(picked) == batch:
                    break
            else:
                view.release()
        t0 = time.perf_counter()
        ref.get_many_into(keys[:batch], outs)
        t1 = time.perf_counter()
        got = pool.get_many_into(ns, picked, outs)
        t2 = time.perf_counter()
        assert all(got), got
        out["load"].append(t2 - t1)
        out["load_ref"].append(t1 - t0)
    ref.close()
print(json.dumps(out))
"""


def run(src: Path, work: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    env = dict(os.environ, PYTHONPATH=str(src.resolve()))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        res = subprocess.run([sys.executable, "-c", CHILD, str(work), str(args.chunk),
                              str(args.chunks), str(args.batch), str(args.loads)], env=env,
                             check=True, capture_output=True, text=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result: dict[str, list[float]] = json.loads(res.stdout)
    return result


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=256 << 10)
    parser.add_argument("--chunks", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--loads", type=int, default=40)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    base = args.dir or Path(tempfile.gettempdir())
    runs: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    for _ in range(args.rounds):
        for name in ("before", "after"):
            got = run(getattr(args, name), base / f"kvpool-paths-{os.getpid()}-{name}", args)
            for key, values in got.items():
                runs[name].setdefault(key, []).extend(values)
    print(f"{args.chunk >> 10} KiB chunks, batches of {args.batch}, {args.rounds} rounds "
          f"(median / p99 ms; ratio = kvpool / reference, lower is better)")
    for path, ref_name in (("load", "SsdEngine.get_many_into"), ("save", "np.copyto")):
        for name in ("before", "after"):
            r = runs[name]
            kv, ref = r[path], r[f"{path}_ref"]
            med, p99 = statistics.median(kv), pct(kv, 0.99)
            ref_med, ref_p99 = statistics.median(ref), pct(ref, 0.99)
            print(f"{path:5} {name:6}: {med * 1e3:8.2f} / {p99 * 1e3:8.2f}   ref {ref_name} "
                  f"{ref_med * 1e3:7.2f} / {ref_p99 * 1e3:7.2f}   ratio {med / ref_med:5.2f} / "
                  f"{p99 / ref_p99:5.2f}")


if __name__ == "__main__":
    main()
