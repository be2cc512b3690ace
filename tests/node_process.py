"""Real ``kvpool serve`` processes for tests: started on 127.0.0.1 with a free port and their
own cache dir, stopped by PID (SIGTERM, or SIGKILL to simulate a crash)."""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

_LISTENING = re.compile(r"listening on (\S+):(\d+)")
_METRICS = re.compile(r"metrics on port (\d+)")


def node_config(base: Path, **sections: Any) -> dict[str, Any]:
    """A small node: 64 MiB DRAM, 64 MiB SSD written through (so a restart serves data)."""
    data: dict[str, Any] = {
        "cache_dir": str(base / "cache"),
        "dram": {"capacity": "64MiB", "slab_size": "8MiB"},
        "ssd": {"capacity": "64MiB", "segment_size": "8MiB"},
        "pool": {"ssd_write": "through"},
        "server": {"host": "127.0.0.1", "port": 0},
    }
    for name, values in sections.items():
        if isinstance(values, dict):
            data.setdefault(name, {}).update(values)
        else:
            data[name] = values
    return data


class NodeProcess:
    """One storage node. ``start()`` waits for its listening line; the port is kept across
    restarts (the first start picks a free one). ``fd_limit``: run it with soft = hard
    RLIMIT_NOFILE of that many descriptors (so the node cannot raise it). ``command_prefix``:
    run ``kvpool serve`` through it (``ip netns exec <ns>``: tests/cluster/netns.py)."""

    def __init__(self, base: Path, *, fd_limit: int | None = None,
                 command_prefix: Sequence[str] = (), **sections: Any) -> None:
        base.mkdir(parents=True, exist_ok=True)
        self.base = base
        self.fd_limit = fd_limit
        self.command_prefix = list(command_prefix)
        self.config = node_config(base, **sections)
        self.port: int = int(self.config["server"].get("port", 0))
        self.proc: subprocess.Popen[str] | None = None
        self.log = base / "node.log"
        #: The port of its /metrics (with server.metrics_port set), once started.
        self.metrics_port: int | None = None

    @property
    def address(self) -> str:
        return f"{self.config['server']['host']}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> NodeProcess:
        self.config["server"]["port"] = self.port
        path = self.base / "node.yaml"
        path.write_text(yaml.safe_dump(self.config))
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
        limit = self.fd_limit

        def limit_fds() -> None:
            if limit is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

        with open(self.log, "a") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [*self.command_prefix, sys.executable, "-m", "kvpool.cli", "serve", "--config",
                 str(path)],
                stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                preexec_fn=limit_fds if limit is not None else None)
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"kvpool serve exited ({self.proc.wait()}): "
                                   f"{self.log.read_text()[-2000:]}")
            m = _LISTENING.search(line)
            if m:
                self.port = int(m.group(2))
                metrics = _METRICS.search(line)
                self.metrics_port = int(metrics.group(1)) if metrics else None
                return self
        raise RuntimeError("kvpool serve did not start in time")

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_bytes(self) -> int:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def __enter__(self) -> NodeProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.alive():
            try:
                self.terminate(10)
            except subprocess.TimeoutExpired:
                self.kill9()
