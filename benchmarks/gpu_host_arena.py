"""Host<->device copy speed from the host pool's mapped arena, against torch pinned memory.

Needs a CUDA device and torch (never run in CI; no GPU on the build machine). Run from a
source checkout: ``python benchmarks/gpu_host_arena.py [--chunks 128] [--chunk-mib 2]``.

It starts a host pool in this process (HostServer over a temporary socket, an arena of
chunks x chunk size plus one slab), attaches an AttachedPool *after* importing torch, so the
attach registers the mapped arena with cudaHostRegister (kvpool/host/cuda.py), and checks
that it did. Then, per direction, the median over ``--repeats`` passes of copying every
chunk (one ``copy_`` per chunk, non_blocking, one synchronize per pass):

- h2d: arena slots (pinned views of stored chunks) -> a device tensor, against the same
  copies from one ``torch.empty(..., pin_memory=True)`` buffer, and from pageable memory;
- d2h: a device tensor -> arena slots (reservations, committed after), against the same into
  the pinned buffer and into pageable memory.

Prints GB/s per case and the ratios arena / torch-pinned (expected ~1.0: the same DMA path)
and arena / pageable (expected > 1 on most hosts). Exit 1 when the arena was not registered
or a byte differs, 2 without a device.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch  # before kvpool attaches: its presence is what turns registration on

try:
    from kvpool.config import config_from_dict
except ImportError:  # run from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from kvpool.config import config_from_dict
from kvpool.host.client import AttachedPool, AttachedReservation
from kvpool.host.server import HostServer
from kvpool.keys import KVLayout, Namespace

MiB = 1 << 20


def _timed(copies: list[tuple[torch.Tensor, torch.Tensor]], repeats: int) -> float:
    """Median seconds of one pass: ``dst.copy_(src, non_blocking=True)`` for each pair."""
    times = []
    for _ in range(repeats + 1):  # the first pass warms up and is dropped
        torch.cuda.synchronize()
        started = time.perf_counter()
        for dst, src in copies:
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=128)
    parser.add_argument("--chunk-mib", type=int, default=2, choices=(1, 2, 4, 8, 16))
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_host_arena: no CUDA device", file=sys.stderr)
        return 2
    # float16, 8 layers x 8 heads x 128 dims x K,V = 32 KiB per token
    layout = KVLayout("float16", 8, 8, 128, chunk_tokens=args.chunk_mib * 32)
    ns = Namespace("gpu-host-arena", layout)
    size = ns.chunk_bytes
    slab = max(64 * MiB, size)
    work = Path(tempfile.mkdtemp(prefix="kvpool-gpu-arena-"))
    cfg = config_from_dict({
        "cache_dir": str(work), "ssd": {"enabled": False}, "metrics": {"enabled": False},
        "dram": {"capacity": (args.chunks * size // slab + 2) * slab, "slab_size": slab},
        "host": {"socket": str(work / "host.sock"), "request_timeout_s": 60}})
    server = HostServer(cfg).start()
    pool = AttachedPool(cfg)
    try:
        link = pool._link_now
        if link is None or not link.cuda:
            print("gpu_host_arena: the mapped arena was NOT registered with CUDA",
                  file=sys.stderr)
            return 1
        pool.register_namespace(ns)
        keys = ns.chunk_keys(list(range(args.chunks * layout.chunk_tokens)))
        device = torch.empty((args.chunks, size), dtype=torch.uint8, device="cuda")
        device.random_(0, 256)
        pinned = torch.empty((args.chunks, size), dtype=torch.uint8, pin_memory=True)
        pageable = torch.empty((args.chunks, size), dtype=torch.uint8)
        pageable.fill_(1)  # touched, as the arena is

        # d2h into reserved arena slots, then commit them (they are the chunks read below)
        reservations = pool.reserve_many(ns, keys)
        if not all(isinstance(r, AttachedReservation) and not r._scratch
                   for r in reservations):
            print("gpu_host_arena: not every chunk got an arena slot", file=sys.stderr)
            return 1
        slots = [torch.frombuffer(r.view, dtype=torch.uint8)  # type: ignore[union-attr]
                 for r in reservations]
        d2h = {
            "arena": _timed([(slots[i], device[i]) for i in range(args.chunks)], args.repeats),
            "pinned": _timed([(pinned[i], device[i]) for i in range(args.chunks)], args.repeats),
            "pageable": _timed([(pageable[i], device[i]) for i in range(args.chunks)],
                               args.repeats),
        }
        if pool.commit_many(reservations) != args.chunks:  # type: ignore[arg-type]
            print("gpu_host_arena: commit failed", file=sys.stderr)
            return 1

        # h2d from pinned views of the stored chunks
        views = pool.pin_many(ns, keys)
        with warnings.catch_warnings():  # the views are read-only; torch only reads them
            warnings.simplefilter("ignore", UserWarning)
            stored = [torch.frombuffer(v.data, dtype=torch.uint8)  # type: ignore[union-attr]
                      for v in views]
        target = torch.empty_like(device)
        h2d = {
            "arena": _timed([(target[i], stored[i]) for i in range(args.chunks)], args.repeats),
            "pinned": _timed([(target[i], pinned[i]) for i in range(args.chunks)], args.repeats),
            "pageable": _timed([(target[i], pageable[i]) for i in range(args.chunks)],
                               args.repeats),
        }
        if not torch.equal(target[:, :4096].cpu(), device[:, :4096].cpu()):
            print("gpu_host_arena: bytes differ after the round trip", file=sys.stderr)
            return 1
        del stored, slots  # torch holds the views' buffers until its tensors go
        for v in views:
            if v is not None:
                v.release()
        total = args.chunks * size
        print(f"{args.chunks} x {args.chunk_mib} MiB, median of {args.repeats} passes, "
              f"device {torch.cuda.get_device_name()}")
        for name, case in (("h2d", h2d), ("d2h", d2h)):
            rates = {k: total / s / 1e9 for k, s in case.items()}
            print(f"  {name}: arena {rates['arena']:.1f} GB/s, torch pinned "
                  f"{rates['pinned']:.1f} GB/s, pageable {rates['pageable']:.1f} GB/s; "
                  f"{name}_arena_vs_pinned {case['pinned'] / case['arena']:.2f}, "
                  f"{name}_arena_vs_pageable {case['pageable'] / case['arena']:.2f}")
        return 0
    finally:
        pool.close()
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
