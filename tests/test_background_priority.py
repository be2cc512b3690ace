"""``pool.background_nice``: the pool's write-behind and mover threads run at a higher nice
value than the engine thread that opened the pool (Linux: nice is per thread)."""

import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from kvtest import byte_namespace, payload_for, small_config

from kvpool import KVPool


def nice_of(thread_name: str) -> int:
    for t in threading.enumerate():
        if t.name.startswith(thread_name) and t.native_id is not None:
            return os.getpriority(os.PRIO_PROCESS, t.native_id)
    raise AssertionError(f"no thread named {thread_name}*")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux")
@pytest.mark.parametrize("nice", [10, 0])
def test_background_threads_yield_to_the_engine(tmp_path: Path, nice: int) -> None:
    ns, key = byte_namespace(), (1).to_bytes(16, "little")
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with KVPool(small_config(tmp_path, pool={"background_nice": nice})) as pool:
        pool.register_namespace(ns)
        pool.put(ns, key, payload_for(key))
        assert pool.flush(10)  # the write-behind thread has run
        assert nice_of("kvpool-write-behind-ssd") == min(19, mine + nice)
        assert pool.get_into(ns, key, np.zeros(ns.chunk_bytes, np.uint8))
        pool.delete(ns, key)
    with KVPool(small_config(tmp_path, pool={"background_nice": nice})) as pool:
        pool.register_namespace(ns)
        other = (2).to_bytes(16, "little")
        pool.put(ns, other, payload_for(other))
    # no warm start: DRAM is empty after the reopen, so the prefetch has a chunk to move
    cfg = small_config(tmp_path, pool={"background_nice": nice, "warm_start_fraction": 0})
    with KVPool(cfg) as pool:
        pool.register_namespace(ns)
        future = pool.prefetch(ns, [other])
        assert future is not None and future.result(10) == 1
        assert nice_of("kvpool-mover") == min(19, mine + nice)
