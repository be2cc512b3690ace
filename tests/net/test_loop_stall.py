"""Nothing one client does stalls another's requests (issue 24, item 2): an idle connection
PINGs a real ``kvpool serve`` in a loop while another client declares a namespace over a large
SSD index (the first declare after a restart sorts the index for the warm start) and while
256 MiB PUTs run (each copied into the SSD's write-behind staging). The PING latency is the
stall the idle connection sees (each connection has a thread of its own: what it waits for
is the GIL and a core).

The index is written before the node starts by an in-process engine on the node's cache_dir
(``KVPOOL_STALL_RECORDS`` records of one 8 KiB block pair each; 300,000 by default, 8-18 s
here). The issue's target is a 5 ms stall; on a contended 2-core CI box the bounds asserted
are ``MAX_STALL_S`` and ``MAX_PUT_STALL_S`` (or ``IDLE_FACTOR`` times the idle window's
worst PING, on a machine loaded by others), far below what the old node stalled (the sort
on its event loop; the PUT's copy into fresh staging pages with the GIL held: hundreds of
ms). The measured stalls are printed (``pytest -s``).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
from node_process import NodeProcess

from kvpool.config import config_from_dict
from kvpool.keys import KVLayout, Namespace
from kvpool.net.connection import NodeConnection
from kvpool.net.protocol import RemoteError, Status
from kvpool.ssd.engine import SsdEngine

RECORDS = int(os.environ.get("KVPOOL_STALL_RECORDS", "300000"))
RECORD_BYTES = 8 << 10  # a header block and a payload block
SEGMENT = 64 << 20
PUT_CHUNK = 4 << 20
PUT_BYTES = 256 << 20
PUTS = 3
#: The bounds asserted (the issue's target is 5 ms; CI boxes are contended: an idle node's
#: PINGs alone see 5-27 ms there). The old node stalled 100-180 ms during the declares (300k
#: records; 0.8 s per million) and 480-750 ms during the PUTs.
MAX_STALL_S = 0.050
MAX_PUT_STALL_S = 0.100
#: On a machine loaded by other work (a clean-clone run beside other jobs: load 19 on 2
#: cores) the idle PINGs themselves wait tens of ms; there the bounds are this many times
#: the worst PING of a 2 s idle window measured first in the same run.
IDLE_FACTOR = 4.0

#: 256-byte chunks: the smallest records, so the index is large for its bytes.
SMALL = Namespace("stall-index", KVLayout("int8", 1, 1, 16, chunk_tokens=16, kv_factor=1))
OTHER = Namespace("stall-other", KVLayout("int8", 1, 1, 16, chunk_tokens=16, kv_factor=1))
BIG = Namespace("stall-put", KVLayout("int8", 1, 1, 4096, chunk_tokens=1024, kv_factor=1))


def _segments(nbytes: int) -> int:
    return -(-nbytes // SEGMENT)


def _node(base: Path) -> NodeProcess:
    capacity = (_segments(RECORDS * RECORD_BYTES) + _segments(PUTS * PUT_BYTES) + 4) * SEGMENT
    return NodeProcess(
        base,
        dram={"capacity": "512MiB", "slab_size": "8MiB"},
        ssd={"capacity": capacity, "segment_size": SEGMENT},
        pool={"write_behind_bytes": "512MiB", "warm_start_fraction": 0.001},
        # one namespace: declaring OTHER forgets SMALL, so the next declare of SMALL
        # registers it again (and sorts again)
        server={"max_namespaces": 1, "max_frame_bytes": PUT_BYTES + (1 << 20)})


def _fill(node: NodeProcess) -> float:
    """Write RECORDS tiny chunks of SMALL where the node will find them; seconds taken."""
    started = time.monotonic()
    engine = SsdEngine.from_config(config_from_dict(node.config))
    try:
        payload = bytes(SMALL.chunk_bytes)
        keys = np.random.default_rng(24).bytes(16 * RECORDS)
        for start in range(0, RECORDS, 4096):
            engine.put_many([(keys[i * 16:i * 16 + 16], SMALL, payload)
                             for i in range(start, min(RECORDS, start + 4096))])
        assert len(engine) == RECORDS
    finally:
        engine.close()
    return time.monotonic() - started


def _declare_alone(address: str, ns: Namespace) -> float:
    """Declare ``ns`` on a new connection, once the node has released the namespace the
    previous connection declared (BUSY until then: server.max_namespaces is 1); seconds the
    declare that succeeded took."""
    deadline = time.monotonic() + 10
    while True:
        conn = NodeConnection(address, request_timeout=30)
        try:
            started = time.perf_counter()
            conn.declare(ns)
            return time.perf_counter() - started
        except RemoteError as exc:
            if exc.status != Status.BUSY or time.monotonic() > deadline:
                raise
        finally:
            conn.close()
        time.sleep(0.01)


def _wait_for_warm_starts(address: str) -> None:
    """Until the warm starts the declares queued are done (their moves up into DRAM are
    background work the PUTs need not compete with)."""
    conn = NodeConnection(address, request_timeout=30)
    try:
        deadline = time.monotonic() + 20
        while conn.stats()["pool"].get("mover_pending") and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        conn.close()


class Pinger(threading.Thread):
    """PINGs the node on its own connection until stopped; keeps (sent at, latency)."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.conn = NodeConnection(address, request_timeout=30)
        self.samples: list[tuple[float, float]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            sent = time.perf_counter()
            self.conn.ping()
            self.samples.append((sent, time.perf_counter() - sent))
            time.sleep(0.0005)

    def worst(self, since: float, until: float) -> float:
        """The longest PING sent in [since, until]."""
        window = [lat for sent, lat in self.samples if since <= sent <= until]
        assert len(window) > 10, "the pinger did not get to run"
        return max(window)


def test_an_idle_connection_is_not_stalled_by_a_declare_over_a_large_index_nor_by_large_puts(
        tmp_path: Path) -> None:
    node = _node(tmp_path / "node")
    fill_s = _fill(node)
    node.start(timeout_s=60)
    pinger = Pinger(node.address)
    try:
        pinger.start()
        time.sleep(0.1)
        started = time.perf_counter()
        time.sleep(2.0)
        idle = pinger.worst(started, time.perf_counter())

        # (a) the first declare after the restart sorts SMALL's index entries for the warm
        # start; OTHER's declare makes the registry forget SMALL, so each round sorts again
        started = time.perf_counter()
        declare_s = []
        for _ in range(3):
            for ns in (SMALL, OTHER):
                took = _declare_alone(node.address, ns)
                if ns is SMALL:
                    declare_s.append(took)
            time.sleep(0.1)
        declared = time.perf_counter()
        during_declares = pinger.worst(started, declared)
        _wait_for_warm_starts(node.address)
        declared = time.perf_counter()

        # (b) 256 MiB PUTs, each received and committed on its connection's thread
        payload = memoryview(bytearray(PUT_BYTES))
        chunks = [payload[i:i + PUT_CHUNK] for i in range(0, PUT_BYTES, PUT_CHUNK)]
        rng = np.random.default_rng(7)
        conn = NodeConnection(node.address, request_timeout=30)
        for _ in range(PUTS):
            keys = [rng.bytes(16) for _ in chunks]
            assert conn.put(BIG, keys, chunks) == len(chunks)
        conn.close()
        during_puts = pinger.worst(declared, time.perf_counter())
    finally:
        pinger.halt.set()
        pinger.join(30)
        node.kill9()

    print(f"\n{RECORDS} records (filled in {fill_s:.1f} s): idle PING max {idle * 1e3:.1f} ms; "
          f"SMALL declares took "
          f"{', '.join(f'{s * 1e3:.1f}' for s in declare_s)} ms; max PING stall "
          f"{during_declares * 1e3:.1f} ms during the declares, {during_puts * 1e3:.1f} ms "
          f"during {PUTS} PUTs of {PUT_BYTES >> 20} MiB")
    # A machine loaded by others stalls an idle node's PINGs by itself: the bounds grow
    # with the worst PING of the idle window measured just before.
    assert during_declares < max(MAX_STALL_S, IDLE_FACTOR * idle), \
        f"an idle PING waited {during_declares * 1e3:.0f} ms while another client declared"
    assert during_puts < max(MAX_PUT_STALL_S, IDLE_FACTOR * idle), \
        f"an idle PING waited {during_puts * 1e3:.0f} ms while another client PUT 256 MiB"

