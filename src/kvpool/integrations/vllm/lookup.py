"""Scheduler-side lookups answered by the worker process that owns the embedded pool.

vLLM runs the scheduler-side and worker-side connector in different processes (EngineCore and
one worker per rank) unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0``. An embedded kvpool can only
be owned by one process: its SSD engine must never be opened twice, and the DRAM arena's index
lives in the owner's memory. So the worker owns the pool, and the scheduler asks it:

* the worker serves ``lookup(keys) -> leading hits`` on a Linux abstract Unix socket (no file
  to clean up; it disappears with the process), one small request per scheduling decision;
* the socket's name and the worker's namespace reach the scheduler through vLLM's own
  handshake (``get_handshake_metadata`` -> ``set_xfer_handshake_metadata``), after the KV
  caches are registered;
* when scheduler and worker share a process the call is direct, without the socket.

A lookup only reads the index; the answer can go stale before the load (eviction in between).
That is safe: the load then fails, the worker reports the blocks, and vLLM recomputes them.

Wire format (little-endian): request = u32 n + n * 16-byte keys; reply = u32 leading hits.

Failure contract: the client never raises for transport faults. A worker that is not up, slow
past ``timeout_s`` or gone is a miss (0), logged once per outage; the next call reconnects.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import uuid
from collections.abc import Callable, Sequence

from kvpool.keys import KEY_BYTES, split_key_bytes

log = logging.getLogger("kvpool.integrations.vllm")

_U32 = struct.Struct("<I")
MAX_KEYS = 1 << 20  # a 4-billion-token prompt is not a lookup; refuse absurd requests

#: Servers living in this process, by address: a same-process client calls them directly.
_LOCAL: dict[str, LookupServer] = {}


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("peer closed the connection")
        buf += part
    return bytes(buf)


class LookupServer:
    """Answers lookups with ``lookup_fn(keys)`` on a fresh abstract socket. Daemon threads;
    ``close()`` stops accepting. A malformed request closes that connection only."""

    def __init__(self, lookup_fn: Callable[[list[bytes]], int]) -> None:
        self.address = f"kvpool-vllm-{uuid.uuid4().hex}"
        self._lookup_fn = lookup_fn
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + self.address)
        self._sock.listen(16)
        self._closed = False
        _LOCAL[self.address] = self
        threading.Thread(target=self._accept_loop, name="kvpool-lookup", daemon=True).start()

    def lookup(self, keys: list[bytes]) -> int:
        return self._lookup_fn(keys)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="kvpool-lookup-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    (n,) = _U32.unpack(_recv_exact(conn, 4))
                    if n > MAX_KEYS:
                        raise ValueError(f"lookup of {n} keys refused")
                    raw = _recv_exact(conn, n * KEY_BYTES)
                    keys = split_key_bytes(raw)
                    hits = self._lookup_fn(keys)
                    conn.sendall(_U32.pack(hits))
                except (OSError, ConnectionError, ValueError):
                    return
                except Exception:  # a pool fault must not kill the server; it is a miss
                    log.exception("kvpool lookup failed; answering 0")
                    try:
                        conn.sendall(_U32.pack(0))
                    except OSError:
                        return

    def close(self) -> None:
        self._closed = True
        _LOCAL.pop(self.address, None)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


class LookupClient:
    """One worker's lookups from the scheduler process. Thread-safe (one call at a time)."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self.address = address
        self._timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._failing = False

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Leading keys present in the worker's pool; 0 on any transport fault."""
        if not keys:
            return 0
        local = _LOCAL.get(self.address)
        if local is not None:
            return local.lookup(list(keys))
        with self._lock:
            try:
                if self._sock is None:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    sock.settimeout(self._timeout_s)
                    sock.connect("\0" + self.address)
                    self._sock = sock
                self._sock.sendall(_U32.pack(len(keys)) + b"".join(keys))
                (hits,) = _U32.unpack(_recv_exact(self._sock, 4))
                self._failing = False
                return min(int(hits), len(keys))
            except (OSError, ConnectionError) as exc:
                if not self._failing:
                    log.warning("kvpool lookup at worker %s failed (%s); treating as misses",
                                self.address, exc)
                self._failing = True
                self.close_locked()
                return 0

    def close_locked(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self.close_locked()
