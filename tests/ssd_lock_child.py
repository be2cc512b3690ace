"""Child process of tests/test_ssd_lock.py: opens an SSD engine (or a whole KVPool on the
default cache dir), writes chunks, then waits for the parent.

Usage: python ssd_lock_child.py engine PATH CAPACITY SEGMENT_SIZE COUNT SALT
       python ssd_lock_child.py pool COUNT SALT     (KVPool(load_config()): the default
                                                     cache dir, i.e. $XDG_CACHE_HOME/kvpool)

Prints ``locked PID`` and the error on the next line and exits 2 if the medium is held by
another engine; otherwise ``ready PID``, writes COUNT chunks (keys/payloads from kvtest, salted),
prints ``wrote COUNT`` and waits: a line ``close`` on stdin closes the engine and exits 0
(the parent may SIGKILL it instead).
"""

from __future__ import annotations

import os
import sys

from kvtest import byte_namespace, payload_for

from kvpool.errors import CacheDirLockedError

CHUNK = 4096


def key_of(salt: str, i: int) -> bytes:
    return i.to_bytes(8, "little") + salt.encode().ljust(8, b"_")[:8]


def main(argv: list[str]) -> int:
    ns = byte_namespace(CHUNK)
    try:
        if argv[0] == "engine":
            from kvpool.ssd.engine import SsdEngine
            path, capacity, segment, count, salt = argv[1:]
            engine = SsdEngine(path, int(capacity), int(segment))
            put = lambda k: engine.put(k, ns, payload_for(k, CHUNK))  # noqa: E731
            close = engine.close
        else:
            from kvpool import KVPool, load_config
            count, salt = argv[1:]
            pool = KVPool(load_config())
            pool.register_namespace(ns)
            put = lambda k: pool.put(ns, k, payload_for(k, CHUNK))  # noqa: E731
            close = pool.close
    except CacheDirLockedError as exc:
        print(f"locked {exc.holder_pid}\n{exc}", flush=True)
        return 2
    print(f"ready {os.getpid()}", flush=True)
    for i in range(int(count)):
        put(key_of(salt, i))
    print(f"wrote {count}", flush=True)
    if sys.stdin.readline().strip() == "close":
        close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
