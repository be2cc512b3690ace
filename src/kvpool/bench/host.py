"""``kvpool bench host``: an engine attached to the host pool beside its references.

Three ratios, each the median over repeated passes of one run (references measured in the
same run, passes interleaved so noise hits both sides alike):

- ``host_get_vs_inprocess``: 16 x 2 MiB chunks read by this (attached) process into its own
  buffers, against the same read from an in-process DRAM tier (an embedded KVPool): in-process
  seconds / attached seconds (target >= 0.8);
- ``host_get_vs_loopback_node``: 64 x 64 KiB chunks, attached against a KVPool client of a
  local ``kvpool serve`` over TCP loopback: node seconds / attached seconds (target >= 3);
- ``host_dram_copies_4_engines``: DRAM bytes the host pool holds after 4 attached processes
  saved the same 64 chunks, over the bytes of one copy (target <= 1.05).

Every read's bytes are checked against what was written (BenchFailure otherwise).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from kvpool.bench.remote_peers import Process
from kvpool.bench.stats import BenchFailure, run_in_work_dir
from kvpool.buffers import byte_view
from kvpool.config import config_from_dict
from kvpool.host.client import AttachedPool
from kvpool.host.launch import HostProcess
from kvpool.keys import KVLayout, Namespace
from kvpool.pool import KVPool

MiB = 1 << 20
#: 2 MiB chunks (float16, 8 layers x 8 heads x 128 dims x 64 tokens x K,V).
BIG = KVLayout("float16", 8, 8, 128, chunk_tokens=64)
#: 64 KiB chunks.
SMALL = KVLayout("float16", 2, 2, 128, chunk_tokens=32)
ENGINES = 4
COPIES_CHUNKS = 64


def _chunks(ns: Namespace, n: int, seed: int) -> tuple[list[bytes], list[np.ndarray]]:
    keys = ns.chunk_keys(list(range(seed * 100000, seed * 100000 + n * ns.chunk_tokens)))
    rng = np.random.default_rng(seed)
    return keys, [rng.integers(0, 256, ns.chunk_bytes, dtype=np.uint8) for _ in keys]


def _timed_passes(sides: dict[str, Callable[[], object]], passes: int) -> dict[str, float]:
    """Median seconds per side, the sides interleaved pass by pass."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(passes):
        for name, op in sides.items():
            started = time.perf_counter()
            op()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) for name, t in times.items()}


def _reader(pool: Any, ns: Namespace, keys: list[bytes], datas: list[np.ndarray],
            what: str) -> Callable[[], None]:
    outs = [np.empty_like(d) for d in datas]

    def read() -> None:
        if not all(pool.get_many_into(ns, keys, outs)):
            raise BenchFailure(f"{what}: a chunk missed")

    read()
    for out, data in zip(outs, datas, strict=True):
        if not np.array_equal(out, data):
            raise BenchFailure(f"{what}: bytes read back differ from the bytes written")
    return read


def _host_config(work: Path) -> dict[str, Any]:
    return {"cache_dir": str(work / "host"), "ssd": {"enabled": False},
            "dram": {"capacity": 256 * MiB, "slab_size": 8 * MiB, "prefault": "start"},
            "host": {"socket": str(work / "host.sock"), "shm_dir": str(_shm_dir(work))}}


def _shm_dir(work: Path) -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else work


def _child(argv: Sequence[str]) -> int:
    """``python -m kvpool.bench.host save CONFIG MODEL``: attach, save the copies case's
    chunks, print how many were stored."""
    _, config_path, model = argv
    cfg = config_from_dict(yaml.safe_load(Path(config_path).read_text()))
    with AttachedPool(cfg) as pool:
        ns = pool.register_namespace(Namespace(model, SMALL))
        keys, datas = _chunks(ns, COPIES_CHUNKS, 7)
        print(pool.put_many(ns, keys, datas), flush=True)
    return 0


def _copies(config_path: Path, pool: AttachedPool, model: str) -> float:
    """Host DRAM bytes added by ENGINES processes saving the same chunks / one copy's."""
    before = int(pool.stats()["dram"]["used_bytes"])
    children = [subprocess.Popen([sys.executable, "-m", "kvpool.bench.host", "save",
                                  str(config_path), model], stdout=subprocess.PIPE, text=True)
                for _ in range(ENGINES)]
    for child in children:
        out, _ = child.communicate(timeout=120)
        if child.returncode != 0 or int(out.split()[-1]) != COPIES_CHUNKS:
            raise BenchFailure(f"an attached saver failed (exit {child.returncode}): {out!r}")
    held = int(pool.stats()["dram"]["used_bytes"]) - before
    return held / (COPIES_CHUNKS * Namespace(model, SMALL).chunk_bytes)


def run_host_bench(work: Path, passes: int, log: Callable[[str], None]) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    cfg = _host_config(work)
    config_path = work / "host.yaml"
    config_path.write_text(yaml.safe_dump(cfg))
    host = HostProcess(config_path, work / "host.log").start()
    node: Process | None = None
    embedded: KVPool | None = None
    client: KVPool | None = None
    attached = AttachedPool(config_from_dict(cfg))
    try:
        if not attached.attached:
            raise BenchFailure("could not attach to the host pool")
        log("host_get_vs_inprocess: 16 x 2 MiB")
        big = Namespace("bench-host-big", BIG)
        keys, datas = _chunks(big, 16, 1)
        attached.register_namespace(big)
        embedded = KVPool(config_from_dict({
            "cache_dir": str(work / "embedded"), "ssd": {"enabled": False},
            "dram": {"capacity": 64 * MiB, "slab_size": 8 * MiB, "prefault": "start"},
            "metrics": {"enabled": False}}), remote=False, serve_metrics=False)
        embedded.register_namespace(big)
        for pool in (attached, embedded):
            if pool.put_many(big, keys, datas) != len(keys):
                raise BenchFailure("a 2 MiB chunk was not stored")
        big_s = _timed_passes({
            "attached": _reader(attached, big, keys, datas, "attached 2 MiB"),
            "inprocess": _reader(embedded, big, keys, datas, "in-process 2 MiB")}, passes)

        log("host_get_vs_loopback_node: 64 x 64 KiB")
        node_cfg = {"cache_dir": str(work / "node"), "ssd": {"enabled": False},
                    "dram": {"capacity": 64 * MiB, "slab_size": 8 * MiB, "prefault": "start"},
                    "server": {"host": "127.0.0.1", "port": 0}}
        (work / "node.yaml").write_text(yaml.safe_dump(node_cfg))
        node = Process([sys.executable, "-m", "kvpool.cli", "serve", "--config",
                        str(work / "node.yaml")], "listening on ")
        client = KVPool(config_from_dict({
            "cache_dir": str(work / "client"), "ssd": {"enabled": False},
            "dram": {"capacity": 0}, "metrics": {"enabled": False},
            "cluster": {"nodes": [f"127.0.0.1:{node.port}"]}}), serve_metrics=False)
        small = Namespace("bench-host-small", SMALL)
        skeys, sdatas = _chunks(small, 64, 2)
        for pool in (attached, client):
            pool.register_namespace(small)
            pool.put_many(small, skeys, sdatas)
        if not client.flush(60):
            raise BenchFailure("the node client's write-behind did not drain")
        small_s = _timed_passes({
            "attached": _reader(attached, small, skeys, sdatas, "attached 64 KiB"),
            "node": _reader(client, small, skeys, sdatas, "loopback node 64 KiB")}, passes)
        # Where an attached read's time goes: one socket round trip, and the copy alone.
        views = attached.pin_many(small, skeys)
        outs = [np.empty_like(d) for d in sdatas]

        def copy_only() -> None:
            for out, view in zip(outs, views, strict=True):
                byte_view(out, writable=True)[:] = view.data  # type: ignore[union-attr]

        parts_s = _timed_passes({"round_trip": lambda: attached.lookup(small, skeys[:1]),
                                 "copy_only": copy_only}, passes)
        for view in views:
            if view is not None:
                view.release()

        # How the attached reads went: through the read directory (no round trip) or asked.
        reads = attached.stats()["attached"]
        log(f"host_dram_copies_4_engines: {ENGINES} processes x {COPIES_CHUNKS} chunks")
        copies = [_copies(config_path, attached, f"bench-host-copies-{i}") for i in range(3)]
        return {
            "ratios": {
                "host_get_vs_inprocess": big_s["inprocess"] / big_s["attached"],
                "host_get_vs_loopback_node": small_s["node"] / small_s["attached"],
                "host_dram_copies_4_engines": statistics.median(copies),
            },
            "targets": {"host_get_vs_inprocess": ">= 0.8", "host_get_vs_loopback_node": ">= 3",
                        "host_dram_copies_4_engines": "<= 1.05"},
            "median_s": {"attached_16x2MiB": big_s["attached"],
                         "inprocess_16x2MiB": big_s["inprocess"],
                         "attached_64x64KiB": small_s["attached"],
                         "loopback_node_64x64KiB": small_s["node"],
                         "attached_round_trip_1_key": parts_s["round_trip"],
                         "attached_copy_only_64x64KiB": parts_s["copy_only"]},
            "copies_passes": copies,
            "attached_reads": {name: reads[name] for name in
                               ("dram_hits", "direct_hits", "direct_changed", "fallback_hits")},
            "passes": passes,
        }
    finally:
        attached.close()
        for own in (embedded, client):
            if own is not None:
                own.close()
        if node is not None:
            node.close()
        host.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", help="write the report to this file")
    parser.add_argument("--passes", type=int, default=31, help="timed passes per side")
    parser.add_argument("--work-dir", help="scratch directory (default: a temp dir)")


def _show(report: dict[str, Any]) -> None:
    for name, value in report["ratios"].items():
        print(f"{name:30s} {value:6.2f}   target {report['targets'][name]}")
    for name, value in report["median_s"].items():
        print(f"  {name:28s} {value * 1e3:8.3f} ms (median)")


def run_from_args(args: argparse.Namespace) -> int:
    if args.passes < 1:
        print("kvpool bench host: --passes must be at least 1", file=sys.stderr)
        return 2
    return run_in_work_dir(
        "host", args.work_dir, args.json,
        lambda work: run_host_bench(work, args.passes,
                                    lambda m: print(m, file=sys.stderr, flush=True)), _show)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "save":
        sys.exit(_child(sys.argv[1:]))
    sys.exit(2)
