"""What publishing KV events costs the data path: ``KVPool.put_many`` of 64 KiB chunks into
DRAM over an SSD written through (evicting once DRAM is full), with ``events.enabled`` true
against false, interleaved in the same run on the same bytes.

``python benchmarks/bench_events.py [--chunks 2048] [--repeats 5]`` prints the median chunks
per second of each over the passes and the ratio events / no events (1.0 = free), plus the
events published and dropped in the last pass. A fresh pool and cache dir per pass.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from kvpool.config import config_from_dict
from kvpool.keys import KVLayout, Namespace
from kvpool.pool import KVPool

CHUNK = 64 * 1024


def one_pass(base: Path, events: bool, keys: list[bytes], ns: Namespace,
             data: list[np.ndarray]) -> tuple[float, dict[str, object]]:
    cfg = config_from_dict({
        "cache_dir": str(base), "dram": {"capacity": "32MiB", "slab_size": "4MiB",
                                         "prefault": "start"},
        "ssd": {"capacity": "256MiB", "segment_size": "16MiB"},
        "events": {"enabled": events}})
    with KVPool(cfg) as pool:
        pool.register_namespace(ns)
        started = time.perf_counter()
        for i in range(0, len(keys), 16):
            pool.put_many(ns, keys[i:i + 16], data[i:i + 16])
        pool.flush(120)
        rate = len(keys) / (time.perf_counter() - started)
        info = pool.events.info() if pool.events is not None else {}
    return rate, info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--chunks", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    ns = Namespace("bench", KVLayout("uint8", 1, 1, CHUNK, 1, kv_factor=1))
    keys = ns.chunk_keys(list(range(args.chunks)))
    data = [np.full(CHUNK, i % 251, np.uint8) for i in range(args.chunks)]
    rates: dict[bool, list[float]] = {True: [], False: []}
    info: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for events in (False, True) if r % 2 == 0 else (True, False):
                rate, got = one_pass(Path(tmp) / f"{r}-{events}", events, keys, ns, data)
                rates[events].append(rate)
                info = got or info
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    print(f"put_many, {args.chunks} x 64 KiB chunks, median of {args.repeats} passes: "
          f"events on {on:,.0f} chunks/s, off {off:,.0f} chunks/s, ratio on/off {on / off:.3f}; "
          f"last pass published {info.get('published')} events, dropped {info.get('dropped')}")


if __name__ == "__main__":
    main()
