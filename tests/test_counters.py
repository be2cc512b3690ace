"""Counts bumped from several threads at once are exact (kvpool.counters.Counters), both in the
helper and in the tiers that count on IO and caller threads."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from kvtest import CHUNK, byte_namespace, payload_for, small_config

from kvpool import KVLayout, KVPool, Namespace
from kvpool.counters import Counters
from kvpool.ssd.engine import SsdEngine

THREADS = 8


@pytest.fixture(autouse=True)
def _switch_often() -> Iterator[None]:
    """Switch threads every microsecond, so lost updates would show."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def run_threads(work: Callable[[int], None]) -> None:
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def body(t: int) -> None:
        try:
            start.wait()
            work(t)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors


def test_counters_add_is_exact_across_threads() -> None:
    c = Counters("a")

    def work(t: int) -> None:
        for _ in range(20_000):
            c.add("a")
            c.add("b", 2)

    run_threads(work)
    assert c.snapshot() == {"a": THREADS * 20_000, "b": THREADS * 40_000}
    assert c["a"] == THREADS * 20_000 and c["never"] == 0


def test_pool_counts_every_dram_read_from_many_threads(tmp_path: Path) -> None:
    ns = byte_namespace()
    reads = 500
    with KVPool(small_config(tmp_path)) as pool:
        pool.register_namespace(ns)
        keys = [i.to_bytes(8, "little") + b"counters" for i in range(4)]
        pool.put_many(ns, keys, [payload_for(k) for k in keys])

        def work(t: int) -> None:
            out = np.zeros(CHUNK, np.uint8)
            for i in range(reads):
                assert pool.get_into(ns, keys[(t + i) % len(keys)], out)

        run_threads(work)
        st = pool.stats()
        assert st["pool"]["dram_hits"] == THREADS * reads and st["pool"]["misses"] == 0


def test_ssd_engine_counts_every_read_from_many_threads(tmp_path: Path) -> None:
    ns = Namespace("m", KVLayout("uint8", 1, 1, 4096, 1, kv_factor=1))
    reads = 200
    e = SsdEngine(tmp_path, 4 << 20, 1 << 20, "cache", io_threads=4)
    try:
        keys = [i.to_bytes(8, "little") + b"counters" for i in range(8)]
        for k in keys:
            assert e.put(k, ns, np.full(4096, k[0], np.uint8))

        def work(t: int) -> None:
            outs = [np.zeros(4096, np.uint8) for _ in range(2)]
            for i in range(reads // 2):  # batches of 2 go through the engine's IO threads
                pair = [keys[(t + i) % 8], keys[(t + i + 1) % 8]]
                assert e.get_many_into(pair, outs) == [True, True]

        run_threads(work)
        st = e.stats()
        assert st["gets"] == st["hits"] == THREADS * reads and st["misses"] == 0
    finally:
        e.close()
