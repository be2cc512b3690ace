"""Child process of tests/test_pool_durable.py: puts chunks into a durable write-through KVPool
until SIGKILLed.

Key ``i`` is ``key_of(salt, i)`` and its payload ``payload_for(key, CHUNK)``, so the parent can
check any key without being told what was written. Only after ``put`` / ``put_many`` returns
(True / all stored) are the keys' hex appended to the acknowledgement log (a plain write: the
kernel keeps it when the process is killed). Prints ``ready`` once the pool is open. Exit code
4 means a put reported failure.

Usage: python durable_pool_writer.py CACHE_DIR DRAM(0/1) START ACK SALT
"""

from __future__ import annotations

import os
import sys

import numpy as np
import xxhash
from kvtest import byte_namespace, payload_for

from kvpool import KVPool
from kvpool.config import Config, config_from_dict

CHUNK = 4096
MAX_BATCH = 8
NS = byte_namespace(CHUNK, model="durable-torture")


def key_of(salt: str, i: int) -> bytes:
    return bytes(xxhash.xxh3_128_digest(f"{salt}:{i}".encode()))


def durable_config(cache_dir: str, dram: bool) -> Config:
    return config_from_dict({
        "cache_dir": cache_dir,
        "dram": {"capacity": "1MiB" if dram else 0, "slab_size": "256KiB"},
        # Room for every chunk of the test without eviction (each open starts a new segment).
        "ssd": {"capacity": "1GiB", "segment_size": "4MiB", "durability": "durable"},
        "pool": {"ssd_write": "through"},
    })


def main(argv: list[str]) -> int:
    cache_dir, dram, start, ack, salt = argv
    pool = KVPool(durable_config(cache_dir, dram == "1"))
    pool.register_namespace(NS)
    ack_fd = os.open(ack, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    rng = np.random.default_rng(int(start) * 7919 + len(salt))
    print("ready", flush=True)
    i = int(start)
    while True:
        n = int(rng.integers(2, MAX_BATCH + 1)) if rng.random() < 0.3 else 1
        keys = [key_of(salt, j) for j in range(i, i + n)]
        if n == 1:
            if not pool.put(NS, keys[0], payload_for(keys[0], CHUNK)):
                return 4
        elif pool.put_many(NS, keys, [payload_for(k, CHUNK) for k in keys]) != n:
            return 4
        os.write(ack_fd, b"".join(k.hex().encode() + b"\n" for k in keys))
        i += n


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
