"""``kvpool bench remote``: one storage node on loopback beside a raw socket and Redis.

Three servers run as separate processes on 127.0.0.1: a ``kvpool serve`` node (DRAM only, so
the figures are the network path), the raw-socket server of ``remote_peers`` (the most Python
can do over TCP: ``sendall`` / ``recv_into`` of a preallocated buffer, no keys) and
``redis-server`` (persistence off; redis-py with hiredis). The client side runs in this process
with 1 and 4 threads (a connection per thread for every system); each op moves one chunk.

* GET: the chunk lands in the caller's buffer (kvpool: ``recv_into`` straight into it; raw:
  the same; Redis: the returned bytes are copied into it).
* PUT: from the caller's buffer; every pass writes fresh keys (kvpool's node evicts by policy,
  Redis is flushed between passes outside the timing).
* a prefix lookup of 512 keys (all present; one EXISTS with a per-key answer) per call,
  p50 / p99, beside a raw 512-key round trip and Redis ``EXISTS`` of the same 512 keys.
* small GETs: one 4 KiB chunk per call, one thread, p50 / p99 in µs beside the raw socket's
  (``remote_get_4k_p50_us``; calls alternate kvpool / raw), once with the client on one core
  and both servers' threads on another (the headline) and once all on one core
  (``kvpool.bench.cores``: unpinned, the scheduler kept the raw server on the client's core
  and the node off it, and measured that).

One-thread cases run with their threads pinned the same way: the client on one core and
every server's threads on another (the rows, and so ``remote_get_vs_raw_socket`` and
``remote_get_256k_vs_raw_socket``), then, for GETs, all on one core (``same_core`` in the
row: context, no ratio is taken from it). Left unpinned, the scheduler chose per process and
per run: the raw server's 256 KiB GET took 60 µs in one run (kept on the client's core) and
84-94 in the next, the node's 105-150, so the ratio moved 0.54-0.79 with no change of code.
Several threads are not pinned (they load both cores whatever the placement).

Passes alternate kvpool / raw / Redis, the order rotated each repeat, so machine noise (and
what one system's pass leaves behind) hits all three; each GET pass checks the last chunk
every thread read against the bytes written.

TLS: a second node with ``server.tls`` (throwaway certificates from ``openssl``) serves the same
GET case (headline size, 1 thread) to a client with ``cluster.tls``; passes alternate TLS and
plain, and ``remote_get_tls_vs_plain`` is the median TLS pass's throughput / the median plain
pass's (< 1: what TLS costs). Skipped, with a note in ``info``, without an ``openssl`` command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from rich.console import Console

from kvpool.bench.certs import make_certs, openssl_available
from kvpool.bench.cores import Placement, pinned, placements
from kvpool.bench.remote_peers import Process, RawClient, start_raw_server, start_redis
from kvpool.bench.stats import (
    BenchFailure,
    Comparison,
    Timing,
    human_bytes,
    percentile,
    render_table,
    run_pass,
    split,
)
from kvpool.bench.storage_common import namespace_for
from kvpool.buffers import byte_view
from kvpool.config import ClusterConfig, ClusterTlsConfig, parse_size
from kvpool.keys import Namespace
from kvpool.net.client import ClusterClient

KiB, MiB = 1024, 1 << 20


@dataclass(frozen=True)
class RemotePlan:
    sizes: tuple[int, ...] = (256 * KiB, 2 * MiB, 16 * MiB)
    threads: tuple[int, ...] = (1, 4)
    #: Passes per case: at 5 the 4-thread medians moved by a tenth run to run; at 9 the
    #: 256 KiB one-thread ratio moved 0.71-0.95 over ten runs.
    repeats: int = 15
    pass_bytes: int = 128 * MiB
    #: With several threads, each thread moves at least this much per pass (ops cycle over
    #: the stored chunks): four 2 MiB GETs a thread time thread start-up and one time slice,
    #: not the store.
    thread_pass_bytes: int = 64 * MiB
    min_chunks: int = 8
    exists_keys: int = 512
    exists_calls: int = 400
    small_get_calls: int = 3000
    headline_size: int = 2 * MiB
    quick: bool = False
    #: The node's metrics (histograms recorded, /metrics served) on or off.
    metrics: bool = True

    @classmethod
    def quick_plan(cls) -> RemotePlan:
        return cls(repeats=3, pass_bytes=32 * MiB, thread_pass_bytes=32 * MiB,
                   exists_calls=150, small_get_calls=1000, quick=True)

    def chunks(self, size: int) -> int:
        """Chunks stored per size (a 1-thread pass moves each once)."""
        return max(self.min_chunks, self.pass_bytes // size)

    def ops(self, size: int, threads: int) -> int:
        """Ops in one pass of ``threads`` threads: every stored chunk once and, with several
        threads, at least ``thread_pass_bytes`` per thread."""
        if threads <= 1:
            return self.chunks(size)
        return max(self.chunks(size), threads * -(-self.thread_pass_bytes // size))


@dataclass
class _Systems:
    kv: ClusterClient
    raw: list[RawClient]
    redis: Any | None
    #: The server processes' pids (node, raw socket, Redis): pinned with one-thread cases.
    servers: list[int]


def _start_node(scratch: Path, plan: RemotePlan, tls: dict[str, str] | None = None,
                name: str = "node") -> Process:
    """The kvpool node: DRAM for every size's GET set (only the headline size's with
    ``tls``, the TLS case's node), TLS when ``tls`` (server.tls) is given."""
    sizes = (plan.headline_size,) if tls else plan.sizes
    biggest = max(sizes)
    slab = max(64 * MiB, biggest)
    # Every size's GET set stays resident (PUT passes evict within their size class).
    per_size = max(plan.pass_bytes, plan.min_chunks * biggest) + 2 * slab
    server: dict[str, Any] = {"host": "127.0.0.1", "port": 0,
                              "metrics_port": 0 if plan.metrics else None}
    if tls:
        server["tls"] = tls
    cfg = {"cache_dir": str(scratch / name),
           "dram": {"capacity": len(sizes) * per_size, "slab_size": slab,
                    "prefault": "start"},
           "ssd": {"enabled": False},
           "metrics": {"enabled": plan.metrics},
           "server": server}
    path = scratch / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return Process([sys.executable, "-m", "kvpool.cli", "serve", "--config", str(path)],
                   "listening on ")


def _verify(what: str, got: np.ndarray, expected: np.ndarray) -> None:
    if not np.array_equal(got, expected):
        raise BenchFailure(f"{what}: bytes read back differ from the bytes written")


def _bench_size(sys_: _Systems, plan: RemotePlan, size: int, rows: list[Comparison],
                log: Callable[[str], None]) -> None:
    ns = namespace_for(size)
    sys_.kv.register_namespace(ns)
    n = plan.chunks(size)
    distinct = 4
    rng = np.random.default_rng(size)
    data = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(distinct)]
    views = [byte_view(d) for d in data]
    items = list(range(n))
    get_keys = [os.urandom(16) for _ in items]
    rkeys = [k.hex().encode() for k in get_keys]
    assert sys_.kv.put_many([(k, ns, views[i % distinct]) for i, k in enumerate(get_keys)]) == n
    _fill_raw(sys_.raw[0], [(i, views[i % distinct]) for i in items])  # the GET slots
    if sys_.redis is not None:
        for i, rk in enumerate(rkeys):
            sys_.redis.set(rk, views[i % distinct])
    outs = [np.zeros(size, np.uint8) for _ in range(max(plan.threads))]
    out_views = [byte_view(o, writable=True) for o in outs]

    # A pass's op i reads stored chunk i % n (every system the same chunk).
    def kv_get(t: int, i: int) -> bool:
        return sys_.kv.get_many_into(ns, [get_keys[i % n]], [out_views[t]])[0]

    def raw_get(t: int, i: int) -> bool:
        return sys_.raw[t].get_into(i % n, out_views[t])

    redis: Any = sys_.redis

    def redis_get(t: int, i: int) -> bool:
        value = redis.get(rkeys[i % n])
        if value is None:
            return False
        out_views[t][:] = value
        return True

    get_ops = {"kvpool": kv_get, "raw": raw_get, "redis": redis_get}
    for threads in plan.threads:
        pass_items = list(range(plan.ops(size, threads)))
        by_placement: dict[str, dict[str, Timing]] = {}
        for placement in _placements_for(threads):
            timings = {"kvpool": Timing(size), "raw": Timing(size), "redis": Timing(size)}
            with pinned(placement, sys_.servers):
                for repeat in range(plan.repeats):
                    for name, op in _rotated(get_ops, repeat):
                        if name == "redis" and sys_.redis is None:
                            continue
                        timings[name].add(run_pass(op, pass_items, threads))
                        for t, part in enumerate(split(pass_items, threads)):
                            if part:
                                _verify(f"{name} get", outs[t], data[part[-1] % n % distinct])
            by_placement[placement[0]] = timings
        _add_rows(rows, "get", size, threads, by_placement, log)

    _fill_raw(sys_.raw[0], [(n + i, views[i % distinct]) for i in items])  # the PUT slots
    put_pass = [0]

    def fresh(p: int, i: int) -> bytes:
        return p.to_bytes(4, "little") + i.to_bytes(4, "little") + bytes(8)

    def kv_put(t: int, i: int) -> bool:
        key = fresh(put_pass[0], i)
        return sys_.kv.put_many([(key, ns, views[i % distinct])]) == 1

    def raw_put(t: int, i: int) -> bool:
        return sys_.raw[t].put(n + i % n, views[i % distinct])

    def redis_put(t: int, i: int) -> bool:
        return bool(redis.set(b"p" + fresh(put_pass[0], i), views[i % distinct]))

    put_ops = {"kvpool": kv_put, "raw": raw_put, "redis": redis_put}
    for threads in plan.threads:
        timings = {"kvpool": Timing(size), "raw": Timing(size), "redis": Timing(size)}
        pass_items = list(range(plan.ops(size, threads)))
        placement = _placements_for(threads)[0]  # PUTs: the headline placement only
        with pinned(placement, sys_.servers):
            for repeat in range(plan.repeats):
                put_pass[0] += 1
                for name, op in _rotated(put_ops, repeat):
                    if name == "redis":
                        if sys_.redis is None:
                            continue
                        sys_.redis.flushall()  # untimed: Redis holds only this pass's chunks
                    timings[name].add(run_pass(op, pass_items, threads))
        _add_rows(rows, "put", size, threads, {placement[0]: timings}, log)
    if sys_.redis is not None:
        sys_.redis.flushall()
    sys_.kv.invalidate(ns)  # the next size starts with the node's memory free


UNPINNED: Placement = ("unpinned", None, None)


def _fill_raw(raw: RawClient, slots: Sequence[tuple[int, memoryview]]) -> None:
    """Write each (slot number, bytes) to the raw server before a case's passes, as kvpool's
    and Redis's chunks are stored before theirs (and kvpool's arena is prefaulted): no timed
    pass pays the raw server's first-touch page faults. Raises BenchFailure if one is not
    acknowledged."""
    if not all(raw.put(slot, data) for slot, data in slots):
        raise BenchFailure("the raw server did not store its chunks")
_Op = Callable[[int, int], bool]


def _rotated(ops: Mapping[str, _Op], repeat: int) -> list[tuple[str, _Op]]:
    """The systems' passes in the order of repeat ``repeat``: rotated by one each repeat, so
    each system follows each other equally often (what one leaves behind, a Redis pass's
    freed memory or a node's cold caches, falls on every system alike)."""
    items = list(ops.items())
    k = repeat % len(items)
    return items[k:] + items[:k]


def _placements_for(threads: int) -> list[Placement]:
    """Where a case's threads run, the headline first: one thread pinned as
    ``kvpool.bench.cores`` places it (the servers on a core of their own, then all on one);
    several threads unpinned."""
    return placements() if threads == 1 else [UNPINNED]


def _add_rows(rows: list[Comparison], case: str, size: int, threads: int,
              by_placement: dict[str, dict[str, Timing]], log: Callable[[str], None]) -> None:
    """Rows of one case from its first (headline) placement's timings; the other placements'
    ratios to the raw socket ride along in the row (``placements``) and the log."""
    headline, timings = next(iter(by_placement.items()))
    others = {where: Comparison("remote", case, size, threads, t["kvpool"], t["raw"],
                                "raw socket").ratio
              for where, t in list(by_placement.items())[1:]}
    extra: dict[str, Any] = {"placement": headline}
    if others:
        extra["placements"] = others
    raw = Comparison("remote", case, size, threads, timings["kvpool"], timings["raw"],
                     "raw socket", extra=extra)
    rows.append(raw)
    line = (f"  {case} {human_bytes(size)} {threads}t: kvpool {raw.kvpool.gb_per_s:.2f} GB/s, "
            f"raw {raw.reference.gb_per_s:.2f} GB/s ({raw.ratio:.2f}x)")
    if timings["redis"].passes:
        red = Comparison("remote", case, size, threads, timings["kvpool"], timings["redis"],
                         "redis", extra=extra)
        rows.append(red)
        line += f", redis {red.reference.gb_per_s:.2f} GB/s ({red.ratio:.2f}x)"
    if threads == 1:
        line += f" ({headline}" + "".join(f"; {w} {r:.2f}x" for w, r in others.items()) + ")"
    log(line)


def _bench_exists(sys_: _Systems, plan: RemotePlan) -> dict[str, Any]:
    ns: Namespace = namespace_for(4 * KiB)
    sys_.kv.register_namespace(ns)
    keys = [os.urandom(16) for _ in range(plan.exists_keys)]
    chunk = byte_view(np.zeros(4 * KiB, np.uint8))
    assert sys_.kv.put_many([(k, ns, chunk) for k in keys]) == len(keys)
    rkeys = [k.hex().encode() for k in keys]
    if sys_.redis is not None:
        sys_.redis.mset({rk: b"x" for rk in rkeys})
    packed = b"".join(keys)
    lat: dict[str, list[float]] = {"kvpool": [], "raw": [], "redis": []}
    for _ in range(plan.exists_calls):
        t0 = time.perf_counter()
        if sys_.kv.exists_prefix(ns, keys) != len(keys):
            raise BenchFailure("the lookup did not find every stored key")
        lat["kvpool"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        sys_.raw[0].exists(packed)
        lat["raw"].append(time.perf_counter() - t0)
        if sys_.redis is not None:
            t0 = time.perf_counter()
            if sys_.redis.exists(*rkeys) != len(keys):
                raise BenchFailure("redis EXISTS did not find every key")
            lat["redis"].append(time.perf_counter() - t0)
    return {name: {"p50_ms": percentile(v, 50) * 1e3, "p99_ms": percentile(v, 99) * 1e3,
                   "calls": len(v)} for name, v in lat.items() if v}


def _bench_small_get(sys_: _Systems, plan: RemotePlan,
                     servers: Sequence[int]) -> dict[str, Any]:
    """One 4 KiB GET per call, one thread, calls alternating kvpool / raw socket: the
    per-request cost where the bytes cost nothing. Measured once per placement of the threads
    (``kvpool.bench.cores``: the client on one core and both servers' threads on another,
    then all on one), so both systems meet the same wake-ups; the first placement is the
    headline. Raises BenchFailure on a miss or wrong bytes."""
    size = 4 * KiB
    ns: Namespace = namespace_for(size)
    sys_.kv.register_namespace(ns)
    keys = [os.urandom(16) for _ in range(64)]
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    if sys_.kv.put_many([(k, ns, byte_view(data)) for k in keys]) != len(keys):
        raise BenchFailure("the small GET case could not store its chunks")
    _fill_raw(sys_.raw[0], [(slot, byte_view(data)) for slot in range(8)])
    out = np.zeros(size, np.uint8)
    view = byte_view(out, writable=True)
    kv, raw = sys_.kv, sys_.raw[0]
    by_placement: dict[str, dict[str, Any]] = {}
    for placement in placements():
        lat: dict[str, list[float]] = {"kvpool": [], "raw": []}
        with pinned(placement, servers):
            for i in range(plan.small_get_calls + 50):  # the first 50: warm-up, not kept
                key = [keys[i % len(keys)]]
                t0 = time.perf_counter()
                hit = kv.get_many_into(ns, key, [view])[0]
                t1 = time.perf_counter()
                raw.get_into(i % 8, view[:size])
                t2 = time.perf_counter()
                if not hit:
                    raise BenchFailure("a small GET missed a stored chunk")
                if i >= 50:
                    lat["kvpool"].append(t1 - t0)
                    lat["raw"].append(t2 - t1)
        by_placement[placement[0]] = {
            name: {"p50_us": percentile(v, 50) * 1e6, "p99_us": percentile(v, 99) * 1e6,
                   "calls": len(v)} for name, v in lat.items()}
    kv.get_many_into(ns, keys[:1], [view])
    _verify("small get", out, data)
    sys_.kv.invalidate(ns)
    headline = next(iter(by_placement))
    return {**by_placement[headline], "placement": headline, "placements": by_placement}


def _bench_tls(sys_: _Systems, plan: RemotePlan, scratch: Path,
               log: Callable[[str], None]) -> Comparison:
    """The GET case at the headline size, 1 thread, through a TLS node (kvpool) vs the plain
    node (reference), passes alternating. Raises BenchFailure on wrong bytes, OSError /
    CalledProcessError if the certificates cannot be made, RuntimeError if the node cannot
    start."""
    certs = make_certs(scratch / "certs")
    size = plan.headline_size
    node = _start_node(scratch, plan, {"cert_file": str(certs.node_cert),
                                       "key_file": str(certs.node_key)}, "tls-node")
    tls_kv = None
    try:
        tls_kv = ClusterClient(ClusterConfig(
            nodes=[f"127.0.0.1:{node.port}"], request_timeout_s=60,
            tls=ClusterTlsConfig(enabled=True, ca_file=str(certs.ca))))
        ns = namespace_for(size)
        clients = {"tls": tls_kv, "plain": sys_.kv}
        n = plan.chunks(size)
        data = np.random.default_rng(size + 1).integers(0, 256, size, dtype=np.uint8)
        keys = [os.urandom(16) for _ in range(n)]
        for kv in clients.values():
            kv.register_namespace(ns)
            if kv.put_many([(k, ns, byte_view(data)) for k in keys]) != n:
                raise BenchFailure("the TLS case could not store its chunks")
        out = np.zeros(size, np.uint8)
        out_view = byte_view(out, writable=True)
        timings = {name: Timing(size) for name in clients}
        items = list(range(plan.ops(size, 1)))
        for _ in range(plan.repeats):
            for name, kv in clients.items():
                def get(t: int, i: int, kv: ClusterClient = kv) -> bool:
                    return kv.get_many_into(ns, [keys[i % n]], [out_view])[0]
                out[:] = 0
                timings[name].add(run_pass(get, items, 1))
                _verify(f"{name} get", out, data)
        sys_.kv.invalidate(ns)
    finally:
        if tls_kv is not None:
            tls_kv.close()
        node.close()
    row = Comparison("remote", "get", size, 1, timings["tls"], timings["plain"], "plain",
                     note="kvpool = through a TLS node; reference = the plain node")
    log(f"  get {human_bytes(size)} 1t over TLS: {row.kvpool.gb_per_s:.2f} GB/s, plain "
        f"{row.reference.gb_per_s:.2f} GB/s ({row.ratio:.2f}x)")
    return row


def _ratio(rows: Sequence[Comparison], case: str, size: int, threads: int,
           ref: str) -> float | None:
    for r in rows:
        if (r.case, r.chunk_bytes, r.threads, r.reference_name) == (case, size, threads, ref):
            return r.ratio
    return None


def run_remote_bench(plan: RemotePlan,
                     log: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Run every case; returns the JSON-ready result. Raises BenchFailure on wrong bytes or a
    failed operation, RuntimeError if a server cannot start."""
    started = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="kvpool-bench-remote-"))
    procs: list[Process] = []
    systems: _Systems | None = None
    rows: list[Comparison] = []
    tls_row: Comparison | None = None
    info: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        node = _start_node(scratch, plan)
        procs.append(node)
        raw = start_raw_server()
        procs.append(raw)
        redis_started = start_redis(scratch)
        redis_client = None
        if redis_started is None:
            info["redis"] = "not installed (bash scripts/system-deps.sh; pip install redis hiredis)"
            log("redis-server or redis-py missing: Redis rows skipped")
        else:
            procs.append(redis_started[0])
            redis_client = redis_started[1]
            info["redis"] = redis_client.info("server").get("redis_version")
            import redis
            info["redis_py"] = redis.__version__
            info["hiredis"] = bool(getattr(redis.utils, "HIREDIS_AVAILABLE", False))
        kv = ClusterClient(ClusterConfig(nodes=[f"127.0.0.1:{node.port}"],
                                         connections_per_node=max(plan.threads),
                                         request_timeout_s=60))
        servers = [node.proc.pid, raw.proc.pid]
        if redis_started is not None:
            servers.append(redis_started[0].proc.pid)
        systems = _Systems(kv, [RawClient(raw.port) for _ in range(max(plan.threads))],
                           redis_client, servers)
        for size in plan.sizes:
            log(f"{human_bytes(size)} chunks: {plan.chunks(size)} per pass")
            _bench_size(systems, plan, size, rows, log)
        exists = _bench_exists(systems, plan)
        small_get = _bench_small_get(systems, plan, systems.servers)
        for where, fig in small_get["placements"].items():
            log(f"  get 4 KiB 1t ({where}): kvpool p50 {fig['kvpool']['p50_us']:.0f} µs, raw "
                f"{fig['raw']['p50_us']:.0f} µs")
        if openssl_available():
            tls_row = _bench_tls(systems, plan, scratch, log)
        else:
            info["tls"] = "skipped: no openssl command to make throwaway certificates"
            log("openssl missing: the TLS case skipped")
    finally:
        if systems is not None:
            systems.kv.close()
            for client in systems.raw:
                client.close()
        for proc in procs:
            proc.close()
        shutil.rmtree(scratch, ignore_errors=True)
    h = plan.headline_size
    ratios: dict[str, float] = {}
    for op in ("get", "put"):
        for ref, name in (("raw socket", "raw_socket"), ("redis", "redis")):
            for threads in plan.threads:
                value = _ratio(rows, op, h, threads, ref)
                if value is not None:
                    suffix = "" if threads == 1 else f"_{threads}t"
                    ratios[f"remote_{op}_vs_{name}{suffix}"] = value
    small = _ratio(rows, "get", 256 * KiB, 1, "raw socket")
    if small is not None:
        ratios["remote_get_256k_vs_raw_socket"] = small
    if tls_row is not None:
        ratios["remote_get_tls_vs_plain"] = tls_row.ratio
    ratios["remote_get_4k_vs_raw_socket"] = (small_get["raw"]["p50_us"]
                                             / small_get["kvpool"]["p50_us"])
    return {
        "bench": "remote",
        "quick": plan.quick,
        "plan": asdict(plan),
        "ratios": ratios,
        "ratio_basis": f"kvpool / reference throughput at {human_bytes(h)} chunks, 1 thread "
                       "(suffix _4t: 4 threads), one chunk per op; tls_vs_plain: GETs "
                       "through a TLS node / the plain node, median passes; one thread "
                       "with the client and the servers on cores of their own (cases' "
                       "placement), several unpinned",
        "exists_prefix_512_p99_ms": exists["kvpool"]["p99_ms"],
        "exists_prefix": exists,
        "remote_get_4k_p50_us": small_get["kvpool"]["p50_us"],
        "remote_get_4k_placement": small_get["placement"],
        "small_get": small_get,
        "cases": [dict(r.to_json(), id=f"{r.case}/{r.chunk_bytes}/{r.threads}t/"
                                       f"{r.reference_name}") for r in rows],
        "tls": None if tls_row is None else tls_row.to_json(),
        "info": info,
        "elapsed_s": time.perf_counter() - started,
        "_rows": rows,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="smaller passes (< 1 minute)")
    parser.add_argument("--json", metavar="PATH", type=Path, default=None,
                        help="also write the results (ratios and every case) as JSON")
    parser.add_argument("--repeats", metavar="N", type=int, default=None,
                        help="timed passes per case (default 9, --quick 3)")
    parser.add_argument("--sizes", metavar="LIST", default=None,
                        help="chunk sizes, comma-separated (e.g. 2MiB or 256KiB,2MiB; default "
                             "256KiB,2MiB,16MiB); the ratios are taken at 2MiB when listed, "
                             "else at the first")
    parser.add_argument("--pass-bytes", metavar="SIZE", default=None,
                        help="bytes each timed pass moves (default 128MiB, --quick 32MiB): "
                             "more ops per pass, steadier figures on a loaded machine")
    parser.add_argument("--exists-calls", metavar="N", type=int, default=None,
                        help="timed 512-key lookups (default 400, --quick 150)")
    parser.add_argument("--metrics", choices=("on", "off"), default="on",
                        help="the node's metrics: on (default, as deployed: histograms and "
                             "/metrics) or off, to measure what they cost")


def _plan_from_args(args: argparse.Namespace) -> RemotePlan:
    """The plan the options ask for. Raises ValueError for a malformed or non-positive
    option."""
    plan = RemotePlan.quick_plan() if args.quick else RemotePlan()
    changes: dict[str, Any] = {"metrics": args.metrics == "on"}
    if args.repeats is not None:
        if args.repeats < 1:
            raise ValueError("--repeats must be at least 1")
        changes["repeats"] = args.repeats
    if args.sizes is not None:
        sizes = tuple(parse_size(part.strip()) for part in args.sizes.split(",") if part.strip())
        if not sizes or min(sizes) <= 0:
            raise ValueError("--sizes needs at least one positive size")
        changes["sizes"] = sizes
        changes["headline_size"] = plan.headline_size if plan.headline_size in sizes \
            else sizes[0]
    if args.pass_bytes is not None:
        changes["pass_bytes"] = parse_size(args.pass_bytes)
        if changes["pass_bytes"] <= 0:
            raise ValueError("--pass-bytes must be positive")
    if args.exists_calls is not None:
        if args.exists_calls < 1:
            raise ValueError("--exists-calls must be at least 1")
        changes["exists_calls"] = args.exists_calls
    return replace(plan, **changes)


def run_from_args(args: argparse.Namespace) -> int:
    console = Console() if Console().is_terminal else Console(width=160)
    err = Console(stderr=True)
    try:
        plan = _plan_from_args(args)
    except ValueError as exc:
        err.print(str(exc))
        return 2
    try:
        result = run_remote_bench(plan, log=lambda m: err.print(f"[dim]{m}[/dim]"))
    except BenchFailure as exc:
        err.print(f"[red]benchmark failed: {exc}[/red]")
        return 1
    except (OSError, RuntimeError) as exc:
        err.print(f"[red]cannot run the benchmark: {exc}[/red]")
        return 2
    rows = result.pop("_rows")
    render_table(rows, "kvpool node (loopback, DRAM) vs raw socket and Redis, one chunk per op",
                 console)
    console.print("lookup (EXISTS) of 512 keys, per call (p50 / p99):")
    for name, fig in result["exists_prefix"].items():
        console.print(f"  {name:8s} {fig['p50_ms']:.3f} ms / {fig['p99_ms']:.3f} ms")
    console.print("GET of one 4 KiB chunk (p50 / p99), by where the threads ran (the first is "
                  "remote_get_4k_p50_us):")
    for where, small in result["small_get"]["placements"].items():
        console.print(f"  {where:10s} kvpool {small['kvpool']['p50_us']:.0f} / "
                      f"{small['kvpool']['p99_us']:.0f} µs, raw socket "
                      f"{small['raw']['p50_us']:.0f} / {small['raw']['p99_us']:.0f} µs")
    console.print("ratios (kvpool / reference, > 1 = kvpool faster):")
    for name, value in result["ratios"].items():
        console.print(f"  {name:32s} {value:6.2f}x")
    console.print(f"redis: {result['info'].get('redis')}; total {result['elapsed_s']:.1f} s"
                  + (" (--quick)" if plan.quick else ""))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
        console.print(f"wrote {args.json}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_remote", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
