"""SSD cases of ``kvpool bench storage``: ``SsdEngine.put`` / ``get_into`` vs raw
``os.pwritev`` / ``os.preadv`` with O_DIRECT of the same bytes (4 KiB-aligned mmap buffers) at
offsets of one preallocated file in the same directory; sequential and random key order; each
of the plan's thread counts. Batched rows: ``get_many_into`` on the engine's own
``io_threads=4`` pool vs the top-thread-count raw reads, and ``put_many`` vs one raw
``pwritev`` per batch on one thread.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvpool.bench.stats import BenchFailure, Comparison, PassResult, Timing, human_bytes, run_pass
from kvpool.bench.storage_common import (
    Run,
    aligned_view,
    check_last,
    drop_cache,
    files_under,
    fresh_keys,
    namespace_for,
    open_engine,
)
from kvpool.keys import Namespace


def _open_direct(path: Path, flags: int) -> tuple[int, bool]:
    """Open with O_DIRECT if the file system allows it (else buffered); (fd, direct)."""
    try:
        return os.open(path, flags | os.O_DIRECT), True
    except OSError:
        return os.open(path, flags), False


def _preallocated(path: Path, nbytes: int) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    finally:
        os.close(fd)


class RawFile:
    """The raw reference: one preallocated file, chunk ``j`` of pass ``p`` at
    ``(p * n + j) * size``, written and read with O_DIRECT."""

    def __init__(self, path: Path, nbytes: int) -> None:
        self.path = path
        _preallocated(path, nbytes)
        self.wfd, self.direct = _open_direct(path, os.O_WRONLY)
        self.rfd, rdirect = _open_direct(path, os.O_RDONLY)
        self.direct = self.direct and rdirect

    def close(self) -> None:
        os.close(self.wfd)
        os.close(self.rfd)
        self.path.unlink(missing_ok=True)


def _order(run: Run, n: int, order: str) -> list[int]:
    return run.rng.permutation(n).tolist() if order == "rand" else list(range(n))


def _ssd_write_case(run: Run, size: int, n: int, ns: Namespace, order: str,
                    threads: int) -> None:
    plan = run.plan
    passes = plan.repeats + 1
    items = _order(run, n, order)
    keys = [fresh_keys(n) for _ in range(passes)]
    views = [[run.src.chunk(size, p * n + i) for i in range(n)] for p in range(passes)]
    kv, ref = Timing(size), Timing(size)
    raw = RawFile(run.scratch / "raw-w.bin", passes * n * size)
    try:
        with open_engine(plan, run.scratch / "ssd-w", size, passes * n) as eng:
            def kv_pass(p: int) -> PassResult:
                ks, vs = keys[p], views[p]
                return run_pass(lambda _t, i: eng.put(ks[i], ns, vs[i]), items, threads)

            def ref_pass(p: int) -> PassResult:
                vs, base = views[p], p * n * size
                return run_pass(
                    lambda _t, i: os.pwritev(raw.wfd, [vs[i]], base + i * size) == size,
                    items, threads)

            run.alternate(kv, ref, kv_pass, ref_pass, warmup=True)
            run.info.setdefault("ssd_direct_io", eng.direct_io)
    finally:
        raw.close()
    run.info.setdefault("raw_direct_io", raw.direct)
    run.add(Comparison("ssd", f"write {order}", size, threads, kv, ref,
                       "raw O_DIRECT", note="fresh space each pass, both sides"))


def _ssd_put_many_case(run: Run, size: int, n: int, ns: Namespace) -> None:
    """put_many(batch) on one thread vs one raw pwritev of the same batch."""
    plan = run.plan
    passes = plan.repeats + 1
    b = min(plan.batch, n)
    nb = n // b
    batches = list(range(nb))
    groups = [[[(key, ns, run.src.chunk(size, p * n + j * b + i))
                for i, key in enumerate(fresh_keys(b))] for j in batches] for p in range(passes)]
    kv, ref = Timing(size, items_per_op=b), Timing(size, items_per_op=b)
    raw = RawFile(run.scratch / "raw-w.bin", passes * nb * b * size)
    try:
        with open_engine(plan, run.scratch / "ssd-w", size, passes * nb * b) as eng:
            def kv_pass(p: int) -> PassResult:
                gs = groups[p]
                return run_pass(lambda _t, j: eng.put_many(gs[j]) == b, batches)

            def ref_pass(p: int) -> PassResult:
                iovs = [[v for _k, _ns, v in g] for g in groups[p]]
                base = p * nb * b * size
                return run_pass(
                    lambda _t, j: os.pwritev(raw.wfd, iovs[j], base + j * b * size) == b * size,
                    batches)

            run.alternate(kv, ref, kv_pass, ref_pass, warmup=True)
    finally:
        raw.close()
    run.add(Comparison("ssd", "put_many", size, 1, kv, ref, "raw, 1 pwritev/batch",
                       note=f"batches of {b}, one thread, seq"))


def _bench_ssd_reads(run: Run, size: int, n: int, ns: Namespace) -> None:
    plan = run.plan
    max_threads = max(plan.threads)
    keys = fresh_keys(n)
    views = [run.src.chunk(size, 7 * n + i) for i in range(n)]
    b = min(plan.batch, n)
    outs = [aligned_view(size) for _ in range(max(max_threads, b))]
    raw = RawFile(run.scratch / "raw-r.bin", n * size)
    ssd_dir = run.scratch / "ssd-r"
    try:
        with open_engine(plan, ssd_dir, size, n) as eng:
            # untimed setup: the same n chunks, written in key order on both sides
            if eng.put_many((keys[i], ns, views[i]) for i in range(n)) != n:
                raise BenchFailure("ssd put_many did not store every chunk")
            for i in range(n):
                if os.pwritev(raw.wfd, [views[i]], i * size) != size:
                    raise BenchFailure("raw pwritev was short")
            files = [*files_under(ssd_dir), raw.path]

            def cold() -> None:
                drop_cache(files)

            def case(order: str, threads: int) -> Comparison:
                items = _order(run, n, order)
                kv, ref = Timing(size), Timing(size)

                def kv_pass(_p: int) -> PassResult:
                    r = run_pass(lambda t, i: eng.get_into(keys[i], outs[t]), items, threads)
                    check_last(run, "ssd get_into", outs, views, items, threads)
                    return r

                def ref_pass(_p: int) -> PassResult:
                    r = run_pass(lambda t, i: os.preadv(raw.rfd, [outs[t]], i * size) == size,
                                 items, threads)
                    check_last(run, "raw preadv", outs, views, items, threads)
                    return r

                run.alternate(kv, ref, kv_pass, ref_pass, warmup=False, before=cold)
                row = Comparison("ssd", f"read {order} cold", size, threads, kv, ref,
                                 "raw O_DIRECT")
                run.add(row)
                return row

            seq_top = None
            for order in ("seq", "rand"):
                for threads in plan.threads:
                    row = case(order, threads)
                    if order == "seq" and threads == max_threads:
                        seq_top = row

            # batched: get_many_into on the engine's own io_threads=4 pool, seq batches
            nb = n // b
            batches = list(range(nb))
            kvb = Timing(size, items_per_op=b)

            def batch_op(_t: int, j: int) -> bool:
                return all(eng.get_many_into(keys[j * b:(j + 1) * b], outs[:b]))

            for _ in range(plan.repeats):
                cold()
                kvb.add(run_pass(batch_op, batches))
                run.verify("ssd get_many_into", outs[b - 1], views[nb * b - 1])
            for i in run.rng.choice(n, size=min(n, 4), replace=False).tolist():
                if not eng.get_into(keys[i], outs[0]):
                    raise BenchFailure("ssd get_into missed a chunk just written")
                run.verify("ssd get_into (sample)", outs[0], views[i])
            if seq_top is not None:
                run.add(Comparison("ssd", "get_many_into cold", size, max_threads, kvb,
                                   seq_top.reference, "raw O_DIRECT",
                                   note=f"batches of {b} on the engine's io_threads=4 pool; "
                                        f"reference = the read seq {max_threads}-thread row"))
    finally:
        raw.close()


def bench_ssd(run: Run, size: int) -> None:
    n = run.plan.chunks(size, run.plan.ssd_pass_bytes)
    run.log(f"SSD {human_bytes(size)}: {n} chunks per pass ({human_bytes(n * size)})")
    ns = namespace_for(size)
    for order in ("seq", "rand"):
        for threads in run.plan.threads:
            _ssd_write_case(run, size, n, ns, order, threads)
    _ssd_put_many_case(run, size, n, ns)
    _bench_ssd_reads(run, size, n, ns)
