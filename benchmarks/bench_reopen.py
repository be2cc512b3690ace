"""Time of an SsdEngine open over a populated log, for two source trees side by side.

``python benchmarks/bench_reopen.py --before /work/main/src --after src`` writes N records
(4 KiB payloads, 64 MiB segments) with each tree's own engine (the on-media format may
differ), closes, then times ``SsdEngine(...)`` on it ``--repeats`` times and prints the
median. Each tree runs in its own child process with only that tree on its path. Scratch
data goes to ``--dir`` (default: a temporary directory) and is removed afterwards.
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
import json, os, sys, time
import numpy as np
from kvpool.keys import KVLayout, Namespace
from kvpool.ssd.engine import SsdEngine
path, n, seg, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ns = Namespace("bench", KVLayout("uint8", 1, 1, 4096, 1, kv_factor=1))
cap = (n * 8192 // seg + 3) * seg
e = SsdEngine(path, cap, seg, "cache")
payload = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8)
batch = 256
for lo in range(0, n, batch):
    e.put_many([(i.to_bytes(8, "little") * 2, ns, payload) for i in range(lo, min(n, lo + batch))])
e.close()
times = []
for _ in range(repeats):
    t0 = time.perf_counter()
    e = SsdEngine(path, cap, seg, "cache")
    times.append(time.perf_counter() - t0)
    assert len(e) == n, (len(e), n)
    e.close()
print(json.dumps({"times": times, "direct_io": e.direct_io}))
"""


def run(src: Path, directory: Path, n: int, seg: int, repeats: int) -> dict[str, object]:
    env = dict(os.environ, PYTHONPATH=str(src.resolve()))
    out = subprocess.run([sys.executable, "-c", CHILD, str(directory), str(n), str(seg),
                          str(repeats)], env=env, check=True, capture_output=True, text=True)
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="source tree (its src/ dir)")
    ap.add_argument("--after", type=Path, required=True, help="source tree (its src/ dir)")
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--segment-size", type=int, default=64 << 20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="kvpool-reopen-", dir=args.dir))
    try:
        for label, src in (("before", args.before), ("after", args.after)):
            directory = scratch / label
            r = run(src, directory, args.records, args.segment_size, args.repeats)
            times = r["times"]
            assert isinstance(times, list)
            print(f"{label:6} {src}: open of {args.records:,} records, median of "
                  f"{len(times)}: {statistics.median(times):.3f} s "
                  f"(all: {', '.join(f'{t:.3f}' for t in times)}; direct_io={r['direct_io']})",
                  flush=True)
            shutil.rmtree(directory)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
