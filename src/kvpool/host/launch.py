"""A ``kvpool host`` child process, for the bench and the tests: started with a config file,
ready once it prints its ``listening`` line, stopped with SIGTERM or killed with SIGKILL by
its own pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


class HostProcess:
    """Raises RuntimeError when the child exits or stays silent past ``timeout_s``."""

    def __init__(self, config_path: Path, log_path: Path) -> None:
        self.config_path, self.log_path = config_path, log_path
        self.proc: subprocess.Popen[str] | None = None

    def start(self, timeout_s: float = 60.0) -> HostProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvpool.cli", "host", "--config",
                 str(self.config_path)], stdout=subprocess.PIPE, stderr=log, text=True,
                env=env)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        lines: list[str] = []
        ready = threading.Event()

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                lines.append(line)
                if "host pool listening" in line:
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        while not ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"kvpool host did not start: {''.join(lines)}"
                                   f"{self.log_path.read_text()[-2000:]}")
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL, as a crash."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL past ``timeout_s``; the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode
