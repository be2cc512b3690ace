"""Several client threads reading from one real node at once: every thread gets its own bytes,
and a node paused (SIGSTOP) mid-read costs each thread a miss within the request timeout,
never a hang, an exception or wrong bytes."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
from kvtest import byte_namespace, payload_for, stop_process, wait_for
from node_process import NodeProcess

from kvpool.config import ClusterConfig
from kvpool.keys import Namespace
from kvpool.net.client import ClusterClient
from kvpool.net.connection import IOV_MAX, NodeConnection

THREADS = 4
HANG_S = 60.0  # only a hang detector: every wait below ends long before it




def stored(client: ClusterClient, chunk: int, n: int) -> tuple[Namespace, list[bytes]]:
    ns = byte_namespace(chunk, salt=f"concurrent-{chunk}")
    client.register_namespace(ns)
    keys = [os.urandom(16) for _ in range(n)]
    assert client.put_many([(k, ns, payload_for(k, chunk)) for k in keys]) == n
    return ns, keys


class Readers:
    """THREADS threads reading random batches until stopped; every answer is checked against
    the bytes written (a miss is allowed, wrong bytes or an exception are recorded)."""

    def __init__(self, client: ClusterClient, ns: Namespace, keys: list[bytes],
                 absent: bytes | None = None) -> None:
        self.client, self.ns, self.keys, self.absent = client, ns, keys, absent
        self.stop = threading.Event()
        self.hits = [0] * THREADS
        self.misses = [0] * THREADS
        self.wrong: list[str] = []
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._read, args=(t,), daemon=True)
                        for t in range(THREADS)]
        for thread in self.threads:
            thread.start()

    def _read(self, t: int) -> None:
        rng = np.random.default_rng(t)
        chunk = self.ns.chunk_bytes
        outs = [np.zeros(chunk, np.uint8) for _ in range(3)]
        try:
            while not self.stop.is_set():
                batch = [self.keys[i] for i in rng.choice(len(self.keys), 3, replace=False)]
                if self.absent is not None and rng.random() < 0.3:
                    batch[1] = self.absent  # a miss between two hits
                found = self.client.get_many_into(self.ns, batch, outs)
                for key, out, hit in zip(batch, outs, found, strict=True):
                    if not hit:
                        if key != self.absent:
                            self.misses[t] += 1
                    elif key == self.absent or not np.array_equal(out, payload_for(key, chunk)):
                        self.wrong.append(key.hex())
                    else:
                        self.hits[t] += 1
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(HANG_S)
            assert not thread.is_alive(), "a reading thread hung"


def test_threads_sharing_a_client_each_get_their_own_bytes(node: NodeProcess) -> None:
    client = ClusterClient(ClusterConfig(nodes=[node.address], connections_per_node=THREADS))
    ns, keys = stored(client, 512 * 1024, 12)
    readers = Readers(client, ns, keys, absent=os.urandom(16))
    wait_for(lambda: min(readers.hits) >= 30, HANG_S, "every thread to read 30 chunks")
    readers.join()
    assert not readers.errors and not readers.wrong
    assert sum(readers.misses) == 0
    client.close()


def test_a_paused_node_is_a_miss_for_every_reading_thread(tmp_path: Path) -> None:
    """Chunks four times the socket buffer, so the pause lands mid-payload for some reads."""
    chunk = 1 << 20
    node = NodeProcess(tmp_path / "paused").start()
    assert node.proc is not None
    client = ClusterClient(ClusterConfig(nodes=[node.address], connections_per_node=THREADS,
                                         request_timeout_s=0.5, retry_down_s=0.2,
                                         socket_buffer_bytes=256 << 10))
    try:
        ns, keys = stored(client, chunk, 8)
        readers = Readers(client, ns, keys)
        wait_for(lambda: min(readers.hits) >= 3, HANG_S, "every thread to read")
        os.kill(node.proc.pid, signal.SIGSTOP)
        misses = list(readers.misses)
        wait_for(lambda: all(m > b for m, b in zip(readers.misses, misses, strict=True)),
                 HANG_S, "a miss on every thread after the pause")
        assert client.stats()["node_failures"] >= 1
        os.kill(node.proc.pid, signal.SIGCONT)
        hits = list(readers.hits)
        wait_for(lambda: all(h > b for h, b in zip(readers.hits, hits, strict=True)),
                 HANG_S, "every thread to read again once the node resumes")
        readers.join()
        assert not readers.errors and not readers.wrong
    finally:
        os.kill(node.proc.pid, signal.SIGCONT)
        client.close()
        node.stop()


def test_a_connection_to_a_paused_node_times_out(tmp_path: Path) -> None:
    """The kernel's socket timeouts (not Python's) bound a receive from a hung node."""
    node = NodeProcess(tmp_path / "hung").start()
    assert node.proc is not None
    try:
        conn = NodeConnection(node.address, request_timeout=0.3)
        ns = byte_namespace(4096, salt="hung")
        key = os.urandom(16)
        assert conn.put(ns, [key], [payload_for(key, 4096)]) == 1
        stop_process(node.proc.pid)
        raised: list[BaseException] = []

        def read() -> None:
            try:
                conn.get_into(ns, [key], [np.zeros(4096, np.uint8)])
            except BaseException as exc:
                raised.append(exc)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(HANG_S)
        assert not reader.is_alive(), "the receive from a paused node never timed out"
        with pytest.raises(TimeoutError, match="moved nothing"):
            raise raised[0]
        conn.close()
    finally:
        os.kill(node.proc.pid, signal.SIGCONT)
        node.stop()


def test_a_batch_of_more_chunks_than_one_scatter_receive_takes(node: NodeProcess) -> None:
    """All hits (one scatter receive per IOV_MAX buffers) and hits around misses."""
    chunk = 4096
    client = ClusterClient(ClusterConfig(nodes=[node.address]))
    ns, keys = stored(client, chunk, IOV_MAX + 90)
    conn = NodeConnection(node.address)
    outs = [np.zeros(chunk, np.uint8) for _ in keys]
    assert conn.get_into(ns, keys, outs) == [True] * len(keys)
    assert all(np.array_equal(o, payload_for(k, chunk)) for k, o in zip(keys, outs,
                                                                         strict=True))
    absent = os.urandom(16)
    mixed = [*keys[:300], absent, *keys[300:], absent]
    outs = [np.zeros(chunk, np.uint8) for _ in mixed]
    assert conn.get_into(ns, mixed, outs) == [k != absent for k in mixed]
    assert all(np.array_equal(o, payload_for(k, chunk)) if k != absent else not o.any()
               for k, o in zip(mixed, outs, strict=True))  # a miss leaves its buffer alone
    conn.close()
    client.close()
