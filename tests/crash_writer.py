"""Child process of tests/test_ssd_crash.py: writes deterministic records until SIGKILLed.

Every record's key is ``key_of(salt, i)`` for a running counter ``i`` and its payload is
``payload_of(key, max_payload)``, so the parent can check any key it finds without being told
what was written. After a put (or put_many) returns, the child appends the keys' hex to the
acknowledgement log and fsyncs it before writing anything else. It prints ``ready`` once the
engine is open. Exit code 3 means the child itself read back wrong bytes.

Usage: python crash_writer.py DIR DURABILITY CAPACITY SEGMENT_SIZE EVICTION START ACK SALT
       MAX_PAYLOAD READS(0/1) DELETES(0/1) PAUSE_S

PAUSE_S bounds a random sleep after each acknowledgement (it keeps the number of records, and
so the parent's checking time, down; 0 writes flat out).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import xxhash

from kvpool.keys import KVLayout, Namespace
from kvpool.ssd.engine import SsdEngine

NS = Namespace("crash", KVLayout("uint8", 1, 1, 65536, 1, kv_factor=1))
MAX_BATCH = 4


def key_of(salt: str, i: int) -> bytes:
    return bytes(xxhash.xxh3_128_digest(f"{salt}:{i}".encode()))


def payload_size(key: bytes, max_payload: int) -> int:
    """Mixes exact multiples of 4 KiB with odd sizes (the padded, copied write path)."""
    if key[4] % 4 == 0:
        return min(max_payload, 4096 * (1 + key[5] % 4))
    return 1 + int.from_bytes(key[:4], "little") % max_payload


def payload_of(key: bytes, max_payload: int) -> np.ndarray:
    rng = np.random.default_rng(int.from_bytes(key[8:], "little"))
    return rng.integers(0, 256, payload_size(key, max_payload), dtype=np.uint8)


def main(argv: list[str]) -> int:
    (path, durability, capacity, segment_size, eviction, start, ack, salt, max_payload,
     reads, deletes, pause) = argv
    cap, seg, first, maxp = int(capacity), int(segment_size), int(start), int(max_payload)
    max_pause = float(pause)
    engine = SsdEngine(path, cap, seg, durability, eviction=eviction)  # type: ignore[arg-type]
    ack_fd = os.open(ack, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    rng = np.random.default_rng(first * 7919 + len(salt))
    print("ready", flush=True)
    i = first
    while True:
        n = int(rng.integers(2, MAX_BATCH + 1)) if rng.random() < 0.3 else 1
        keys = [key_of(salt, j) for j in range(i, i + n)]
        if n == 1:
            if not engine.put(keys[0], NS, payload_of(keys[0], maxp)):
                return 4
        elif engine.put_many([(k, NS, payload_of(k, maxp)) for k in keys]) != n:
            return 4
        os.write(ack_fd, b"".join(k.hex().encode() + b"\n" for k in keys))
        os.fsync(ack_fd)
        i += n
        if max_pause > 0:
            time.sleep(float(rng.uniform(0, max_pause)))
        if reads == "1" and rng.random() < 0.3:
            k = key_of(salt, int(rng.integers(0, i)))
            expected = payload_of(k, maxp)
            out = np.empty_like(expected)
            if engine.get_into(k, out) and not np.array_equal(out, expected):
                return 3
        if deletes == "1" and rng.random() < 0.05:
            engine.delete(key_of(salt, int(rng.integers(0, i))))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
