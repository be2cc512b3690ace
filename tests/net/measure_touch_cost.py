"""Not a test: the cost of replica touches on the read path, printed for a report.

Three local nodes (static membership), replicas=2; 1,000 get_many_into calls of 16 x 64 KiB
chunks and 250 exists_prefix calls of 512 keys. Prints node and client CPU per GET (from
/proc, robust on a loaded machine) and p50 / p99 latencies. Compare source trees with::

    PYTHONPATH=src python tests/net/measure_touch_cost.py
    PYTHONPATH=/path/to/other/src python tests/net/measure_touch_cost.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvtest import byte_namespace, payload_for
from node_process import NodeProcess

import kvpool
from kvpool.config import ClusterConfig
from kvpool.net.client import ClusterClient

CHUNK = 64 * 1024
GETS = 1000


def node_cpu_s(nodes: list[NodeProcess]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for node in nodes:
        assert node.proc is not None
        fields = Path(f"/proc/{node.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return total


def quantile_ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))] * 1e3


def main() -> None:
    base = Path(tempfile.mkdtemp(prefix="kvpool-touch-cost-"))
    nodes = [NodeProcess(base / f"n{i}", server={"node_id": f"node-{i}"}).start()
             for i in range(3)]
    try:
        client = ClusterClient(ClusterConfig(nodes=[n.address for n in nodes], replicas=2))
        ns = byte_namespace(CHUNK, salt="touch-cost")
        client.register_namespace(ns)
        keys = [os.urandom(16) for _ in range(512)]
        client.put_many([(k, ns, payload_for(k, CHUNK)) for k in keys])
        outs = [np.zeros(CHUNK, np.uint8) for _ in range(16)]

        def batch(i: int) -> list[bytes]:
            start = (i * 16) % len(keys)
            return keys[start:start + 16]

        for i in range(100):  # warm connections and caches
            client.get_many_into(ns, batch(i), outs)
        nodes0, client0 = node_cpu_s(nodes), time.process_time()
        gets = []
        for i in range(GETS):
            t = time.perf_counter()
            assert all(client.get_many_into(ns, batch(i), outs))
            gets.append(time.perf_counter() - t)
        nodes1, client1 = node_cpu_s(nodes), time.process_time()
        lookups = []
        for _ in range(250):
            t = time.perf_counter()
            assert client.exists_prefix(ns, keys) == len(keys)
            lookups.append(time.perf_counter() - t)
        touches = {k: v for k, v in client.stats().items() if k.startswith("touch")}
        print(f"{Path(kvpool.__file__).parent}: CPU per GET: nodes "
              f"{(nodes1 - nodes0) / GETS * 1e6:.0f} us, client "
              f"{(client1 - client0) / GETS * 1e6:.0f} us; GET 16x64KiB p50 "
              f"{quantile_ms(gets, 0.5):.2f} ms p99 {quantile_ms(gets, 0.99):.2f} ms; "
              f"lookup of 512 p50 {quantile_ms(lookups, 0.5):.2f} ms p99 "
              f"{quantile_ms(lookups, 0.99):.2f} ms; {touches}")
        client.close()
    finally:
        for node in nodes:
            node.stop()


if __name__ == "__main__":
    main()
