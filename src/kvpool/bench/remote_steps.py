"""Where a 4 KiB remote GET's time goes, step by step (docs/cluster.md's table).

``python -m kvpool.bench.remote_steps [--calls N] [--node-size BYTES]`` prints two tables:

* **node**: a real ``NodeStore`` and ``Connection`` in this process, fed GET frames over a
  loopback TCP pair; each step of ``Connection.handle`` for a GET is run as the code runs it
  and timed on its own (``perf_counter_ns``), medians over ``--calls`` requests of one
  ``--node-size`` chunk (default 4 KiB; the client's steps are of 4 KiB); beside them
  ``handle()`` whole, timed the same way, and the thread CPU time per request (which waiting
  for a core on a loaded machine does not inflate);
* **client**: ``ClusterClient.get_many_into`` against a ``kvpool serve`` process, calls
  alternating with the raw-socket reference of ``kvpool bench remote``, p50 of each; then the
  client's steps, timed one by one on the same connection; once per placement of the
  threads (``kvpool.bench.cores``: the servers on another core, then all on one).

The steps repeat the code path of this version (store.get, NodeConnection.get_views and
_get_answer); when that path changes, so must they. Figures on a loaded machine are
inflated, Python more than the kernel: compare rows of one run, not runs. Raises
RuntimeError if a server cannot start.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from time import perf_counter_ns as now

import numpy as np

from kvpool.bench.cores import Placement, pinned, placements
from kvpool.bench.remote import RemotePlan, _start_node
from kvpool.bench.remote_peers import RawClient, start_raw_server
from kvpool.bench.storage_common import namespace_for
from kvpool.buffers import byte_view
from kvpool.checks import check_keys
from kvpool.config import ClusterConfig, config_from_dict
from kvpool.keys import canonical_json
from kvpool.metrics.recorder import LabeledLatency
from kvpool.net.client import ClusterClient
from kvpool.net.connection import ERROR_ROOM
from kvpool.net.protocol import (
    HEADER,
    HEADER_BYTES,
    MAGIC,
    PROTOCOL_VERSION,
    RESPONSE_BIT,
    Op,
    split_get_keys,
    unpack_header,
)
from kvpool.pool import KVPool
from kvpool.server.connection import Connection
from kvpool.server.store import GetAnswer, NodeStore, scoped_chunk_keys
from kvpool.server.traffic import Traffic

SIZE = 4096
KEYS = [bytes([i]) * 16 for i in range(64)]


def _median_us(values: list[int]) -> float:
    return statistics.median(values) / 1e3


def node_steps(calls: int, size: int = SIZE) -> tuple[dict[str, float], float, float]:
    """(median µs per step, median µs of handle() whole, thread CPU µs per request) of GETs
    of one ``size``-byte chunk."""
    cfg = config_from_dict({"cache_dir": tempfile.mkdtemp(prefix="kvpool-steps-"),
                            "dram": {"capacity": max(64 << 20, 2 * len(KEYS) * size),
                                     "slab_size": max(4 << 20, size)},
                            "ssd": {"enabled": False}, "metrics": {"enabled": True}})
    pool = KVPool(cfg, remote=False, serve_metrics=False, publish_events=False)
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    for sock in (client, server):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        store = NodeStore(pool, cfg.server, "steps")
        traffic = Traffic(LabeledLatency())
        conn = Connection(store, traffic, server)
        session = conn.session
        ns = namespace_for(size)
        store.declare(session, canonical_json(ns.canonical()))
        batch = store.begin_put(session, ns.id, KEYS, len(KEYS) * size)
        for target in batch.targets:
            assert target is not None
            target[:] = bytes(size)
        store.commit_put(batch)
        inbox = memoryview(bytearray(HEADER_BYTES + 1 + size))  # one whole answer
        frames = [HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, Op.GET, i, 1, 32, 0) + ns.id + k
                  for i, k in enumerate(KEYS)]

        def whole(i: int) -> int:
            client.send(frames[i % 64])
            t0 = now()
            req = unpack_header(conn.take(HEADER_BYTES))
            traffic.busy.add(conn)
            conn.handle(req)
            traffic.busy.discard(conn)
            took = now() - t0
            _drain(client, inbox)
            return took

        steps: dict[str, list[int]] = {name: [] for name in (
            "receive and parse the header", "in flight (busy set)", "check, metadata, op count",
            "split keys", "namespace and key scoping (xxhash)",
            "pin (pool.pin_resident: DRAM lock, pins)", "answer: flags, deferred counts",
            "frame", "sendmsg",
            "after the send: unpin, hits and policy touch, pool and node counters",
            "after the send: request latency record")}
        stamps = [0] * 12

        def stepped(i: int) -> None:
            client.send(frames[i % 64])
            stamps[0] = now()
            req = unpack_header(conn.take(HEADER_BYTES))
            stamps[1] = now()
            traffic.busy.add(conn)
            traffic.busy.discard(conn)
            stamps[2] = now()
            conn.check(req)
            meta = conn.take(req.meta_len).tobytes()
            conn.count("op_get")
            stamps[3] = now()
            ns_id, keys, _ = split_get_keys(meta, req.count)
            stamps[4] = now()
            nsx = store._namespace_of(session, ns_id)
            scoped = scoped_chunk_keys(ns_id, keys)
            stamps[5] = now()
            pins = pool.pin_resident(nsx, scoped)
            stamps[6] = now()
            assert pins is not None
            answer = GetAnswer(b"\x01", pins.views, pins,  # type: ignore[arg-type]
                               lambda: store._count_get(nsx, 1, 0))
            stamps[7] = now()
            head = HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, req.op | RESPONSE_BIT, req.req_id,
                               len(answer.views), 1, sum(map(len, answer.views)))
            bufs = [memoryview(head + answer.flags), *answer.views]
            stamps[8] = now()
            conn.write(bufs)
            stamps[9] = now()
            answer.release()
            stamps[10] = now()
            assert traffic.latency is not None
            traffic.latency.record("get", 1e-5)
            stamps[11] = now()
            _drain(client, inbox)
            for j, values in enumerate(steps.values()):
                values.append(stamps[j + 1] - stamps[j])

        gc.collect()
        gc.freeze()
        for i in range(1000):
            whole(i)
        cpu0 = time.thread_time_ns()
        totals = [whole(i) for i in range(calls)]
        cpu = (time.thread_time_ns() - cpu0) / calls / 1e3
        for i in range(calls):
            stepped(i)
        return {k: _median_us(v) for k, v in steps.items()}, _median_us(totals), cpu
    finally:
        client.close()
        server.close()
        listener.close()
        pool.close()


def client_steps(calls: int, placement: Placement) -> tuple[dict[str, float], float, float]:
    """(median µs per client step, kvpool GET p50 µs, raw socket p50 µs), with this thread
    and both servers' threads where ``placement`` says (``kvpool.bench.cores``)."""
    scratch = Path(tempfile.mkdtemp(prefix="kvpool-steps-"))
    node = _start_node(scratch, RemotePlan(sizes=(SIZE,), headline_size=SIZE,
                                           pass_bytes=1 << 20))
    raw_server = start_raw_server()
    raw = RawClient(raw_server.port)
    kv = ClusterClient(ClusterConfig(nodes=[f"127.0.0.1:{node.port}"], request_timeout_s=60))
    try:
        ns = namespace_for(SIZE)
        kv.register_namespace(ns)
        data = np.full(SIZE, 7, np.uint8)
        if kv.put_many([(k, ns, byte_view(data)) for k in KEYS]) != len(KEYS):
            raise RuntimeError("the node did not store the chunks")
        out = np.zeros(SIZE, np.uint8)
        view = byte_view(out, writable=True)
        steps: dict[str, list[int]] = {name: [] for name in (
            "views and size checks", "live nodes and key checks", "connection pool take",
            "frame", "send", "wait for the answer (node, loopback, wake-ups)",
            "parse header and flags, copy out", "give back and counters")}
        stamps = [0] * 9
        kv_lat: list[int] = []
        raw_lat: list[int] = []

        def stepped(i: int) -> None:
            keys = [KEYS[i % 64]]
            stamps[0] = now()
            views = [byte_view(o, writable=True) for o in (view,)]
            if views[0].nbytes != ns.chunk_bytes:
                raise RuntimeError("wrong buffer")
            stamps[1] = now()
            live, _ = kv._view()
            check_keys(keys)
            stamps[2] = now()
            pool = kv._pools[live[0]]
            conn, _ = pool.take_reused()
            stamps[3] = now()
            conn._req_id += 1
            meta = ns.id + b"".join(keys)
            frame = HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, Op.GET, conn._req_id, 1,
                                len(meta), 0)
            buf = memoryview(frame + meta)
            stamps[4] = now()
            conn.sock.send(buf)
            stamps[5] = now()
            inbox = conn._inbox
            have = conn.sock.recv_into(inbox[:HEADER_BYTES + ERROR_ROOM + 1])
            stamps[6] = now()
            while have < HEADER_BYTES + 1 + SIZE:
                have += conn.sock.recv_into(inbox[have:HEADER_BYTES + 1 + SIZE])
            head = HEADER.unpack_from(inbox)
            if head[3] != Op.GET | RESPONSE_BIT or inbox[HEADER_BYTES] != 1:
                raise RuntimeError("not a hit")
            views[0][:] = inbox[HEADER_BYTES + 1:HEADER_BYTES + 1 + SIZE]
            stamps[7] = now()
            pool.give_back(conn)
            kv._counters.add_many({"get_hits": 1, "get_misses": 0})
            stamps[8] = now()
            for j, values in enumerate(steps.values()):
                values.append(stamps[j + 1] - stamps[j])

        def paired(i: int) -> None:
            t0 = now()
            if not kv.get_many_into(ns, [KEYS[i % 64]], [view])[0]:
                raise RuntimeError("a GET missed")
            t1 = now()
            raw.get_into(i % 8, view)
            kv_lat.append(t1 - t0)
            raw_lat.append(now() - t1)

        gc.collect()
        gc.freeze()
        with pinned(placement, [node.proc.pid, raw_server.proc.pid]):
            _run(paired, 300)
            kv_lat.clear()
            raw_lat.clear()
            _run(paired, calls)
            _run(stepped, calls)
        return {k: _median_us(v) for k, v in steps.items()}, _median_us(kv_lat), \
            _median_us(raw_lat)
    finally:
        kv.close()
        raw.close()
        raw_server.close()
        node.close()


def _drain(sock: socket.socket, answer: memoryview) -> None:
    """Receive one whole GET answer (``answer`` is its size)."""
    got = 0
    while got < answer.nbytes:
        got += sock.recv_into(answer[got:])


def _run(fn: Callable[[int], None], calls: int) -> None:
    for i in range(calls):
        fn(i)


def _print_steps(steps: dict[str, float]) -> None:
    for name, us in steps.items():
        print(f"  {name:70s} {us:7.2f} µs")
    print(f"  {'sum of the step medians':70s} {sum(steps.values()):7.2f} µs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="remote_steps", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=5000, help="requests per measurement")
    parser.add_argument("--node-size", type=int, default=SIZE,
                        help="chunk bytes of the node's GETs (the client's are 4 KiB)")
    args = parser.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.1f}, {args.calls} calls")
    steps, whole, cpu = node_steps(args.calls, args.node_size)
    print(f"node, in process: handle() p50 {whole:.1f} µs; thread CPU per request "
          f"(with the client side's send and receive) {cpu:.1f} µs")
    _print_steps(steps)
    for placement in placements():
        csteps, kv_p50, raw_p50 = client_steps(args.calls, placement)
        print(f"client ({placement[0]}): ClusterClient.get_many_into p50 {kv_p50:.1f} µs, "
              f"raw socket p50 {raw_p50:.1f} µs ({kv_p50 / raw_p50:.2f}x)")
        _print_steps(csteps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
