"""The references of ``kvpool bench remote``: a raw-socket server and Redis, each in its own
process on loopback, like the kvpool node.

Raw socket: the most Python can do over TCP. A threaded server (one thread per connection,
blocking sockets) keeps one buffer per chunk number (the same working set as the stores; the
bench writes every slot before its passes: no pass pays first-touch page faults) and answers GET
by ``sendall`` of that buffer and PUT by ``recv_into`` it, with a 12-byte request
header and a 1-byte PUT acknowledgement: no keys, no index, no checks. EXISTS is a
16-byte-per-key request answered with 8 bytes.

Redis: Debian's ``redis-server`` with persistence off; redis-py with hiredis; GET copies the
returned bytes into the caller's buffer (where an engine needs them).
"""

from __future__ import annotations

import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvpool.buffers import advance

REQ = struct.Struct("<BxxxII")  # op, size, slot
OP_GET, OP_PUT, OP_EXISTS = 1, 2, 3


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def _serve_raw_connection(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = memoryview(bytearray(REQ.size))
    scratch = memoryview(bytearray(0))
    with sock:
        while _recv_exact(sock, head):
            op, size, slot = REQ.unpack(head)
            if op == OP_GET:
                sock.sendall(_slot(slot, size))
            elif op == OP_PUT:
                if not _recv_exact(sock, _slot(slot, size)):
                    return
                sock.sendall(b"\x01")
            elif op == OP_EXISTS:
                if scratch.nbytes < size:
                    scratch = memoryview(bytearray(size))
                if not _recv_exact(sock, scratch[:size]):
                    return
                sock.sendall(struct.pack("<Q", size // 16))
            else:
                return


# Chunks by slot number: like a store's working set, the same bytes are not cache-hot.
_SLOTS: dict[tuple[int, int], memoryview] = {}
_SLOTS_LOCK = threading.Lock()


def _slot(slot: int, size: int) -> memoryview:
    with _SLOTS_LOCK:
        buf = _SLOTS.get((slot, size))
        if buf is None:
            buf = _SLOTS[(slot, size)] = memoryview(bytearray(size))
        return buf


def serve_raw(port: int = 0) -> None:
    """Run the raw server until killed; prints ``port N`` once listening."""
    listener = socket.create_server(("127.0.0.1", port), backlog=64)
    print(f"port {listener.getsockname()[1]}", flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_serve_raw_connection, args=(conn,), daemon=True).start()


class RawClient:
    """One connection to the raw server (one per thread)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._ack = memoryview(bytearray(8))

    def get_into(self, slot: int, out: memoryview) -> bool:
        self.sock.sendall(REQ.pack(OP_GET, out.nbytes, slot))
        return _recv_exact(self.sock, out)

    def put(self, slot: int, data: memoryview) -> bool:
        bufs = [memoryview(REQ.pack(OP_PUT, data.nbytes, slot)), data]
        while bufs:  # blocking sendmsg may stop short of the whole request
            advance(bufs, self.sock.sendmsg(bufs))
        return _recv_exact(self.sock, self._ack[:1])

    def exists(self, keys: bytes) -> bool:
        self.sock.sendall(REQ.pack(OP_EXISTS, len(keys), 0) + keys)
        return _recv_exact(self.sock, self._ack)

    def close(self) -> None:
        self.sock.close()


class Process:
    """A child process printing a line that names its port; killed on close."""

    def __init__(self, argv: list[str], ready: str, port: int | None = None,
                 timeout_s: float = 20.0) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdout is not None
        self.port = port or 0
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{argv[0]} exited with {self.proc.wait()}")
            if ready in line:
                if port is None:
                    self.port = int(line.split(ready, 1)[1].split()[0].rsplit(":", 1)[-1])
                threading.Thread(target=self._drain, daemon=True).start()
                return
        self.close()
        raise RuntimeError(f"{argv[0]} did not start within {timeout_s} s")

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for _ in self.proc.stdout:
            pass

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def start_raw_server() -> Process:
    return Process([sys.executable, "-m", "kvpool.bench.remote_peers"], "port ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(scratch: Path) -> tuple[Process, Any] | None:
    """redis-server on a free loopback port and a redis-py client; None (with the reason in
    the bench's info) when redis-server or redis-py is not installed."""
    binary = shutil.which("redis-server")
    if binary is None:
        return None
    try:
        import redis
    except ImportError:
        return None
    port = free_port()
    proc = Process([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                    "--appendonly", "no", "--dir", str(scratch), "--protected-mode", "no"],
                   "Ready to accept connections", port=port)
    client = redis.Redis(host="127.0.0.1", port=port, max_connections=16)
    client.ping()
    return proc, client


if __name__ == "__main__":
    serve_raw(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
