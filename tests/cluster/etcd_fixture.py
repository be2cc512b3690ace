"""A private etcd server for tests: free 127.0.0.1 ports, its own data dir, stopped by PID.

Tests start it through the fixtures in conftest.py; a test that needs to kill or restart etcd
takes the function-scoped ``etcd_server`` and calls :meth:`EtcdServer.kill` /
:meth:`EtcdServer.start` (same data dir and ports unless :meth:`EtcdServer.wipe` is called).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

_names = itertools.count()


def etcd_binary() -> str | None:
    """The etcd binary on PATH (installed by scripts/system-deps.sh), or None."""
    return shutil.which("etcd")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL etcd if the test process dies (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class EtcdServer:
    """One single-member etcd; ``endpoint`` is ``http://127.0.0.1:<client port>``."""

    def __init__(self, base_dir: Path) -> None:
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("etcd is not installed: run scripts/system-deps.sh")
        self.binary = binary
        self.base_dir = base_dir
        self.data_dir = base_dir / "data"
        self.log_path = base_dir / "etcd.log"
        self.name = f"kvpool-test-{os.getpid()}-{next(_names)}"
        self.client_port = free_port()
        self.peer_port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.client_port}"
        self.peer_url = f"http://127.0.0.1:{self.peer_port}"
        self.proc: subprocess.Popen[bytes] | None = None
        #: Run etcd through this (``ip netns exec <ns>``: tests/cluster/netns.py); none here.
        self.command_prefix: list[str] = []

    def start(self, timeout_s: float = 20.0) -> EtcdServer:
        """Start etcd and wait until it answers /health; RuntimeError (with its log) if not."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.base_dir.mkdir(parents=True, exist_ok=True)
        args = [
            *self.command_prefix,
            self.binary,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.endpoint,
            "--advertise-client-urls", self.endpoint,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", f"{self.name}={self.peer_url}",
            "--initial-cluster-token", self.name,
            "--initial-cluster-state", "new",
            # A single member elects itself faster with shorter timers.
            "--heartbeat-interval", "50",
            "--election-timeout", "500",
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT,
                                         preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.healthy():
                return self
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"etcd did not answer within {timeout_s} s:\n{self.log_tail()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.endpoint + "/health", timeout=1) as resp:
                return b'"true"' in resp.read()
        except (OSError, urllib.error.URLError):
            return False

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``; idempotent."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL, as a crash would; idempotent."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.kill()
        proc.wait()

    def wipe(self) -> None:
        """Delete the data dir (etcd must be stopped): the next start is an empty etcd."""
        assert self.proc is None, "stop etcd before wiping its data"
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
