"""Shared test helpers: small namespaces and configs that keep every test on tmp_path.

Imported as ``from kvtest import ...`` (several test folders have their own conftest.py, so
``conftest`` is not a usable module name)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.config import Config, config_from_dict
from kvpool.keys import KVLayout, Namespace

CHUNK = 64 * 1024


def byte_namespace(chunk_bytes: int = CHUNK, model: str = "test-model",
                   salt: str = "") -> Namespace:
    """A namespace whose chunks are ``chunk_bytes`` opaque bytes."""
    return Namespace(model, KVLayout("uint8", 1, 1, chunk_bytes, 1, kv_factor=1),
                     tenant_salt=salt)


def payload_for(key: bytes, nbytes: int = CHUNK) -> np.ndarray:
    """Deterministic bytes derived from the key, so any reader can check what it got."""
    seed = int.from_bytes(key[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def small_config(tmp_path: Path, **sections: dict[str, Any]) -> Config:
    data: dict[str, Any] = {
        "cache_dir": str(tmp_path / "cache"),
        "dram": {"capacity": "1MiB", "slab_size": "256KiB"},
        "ssd": {"capacity": "4MiB", "segment_size": "1MiB"},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return config_from_dict(data)




def child_env() -> dict[str, str]:
    """The environment for a child Python process that must import this checkout's kvpool."""
    import os

    import kvpool

    env = dict(os.environ)
    src = str(Path(kvpool.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


def read_acks(ack: Path) -> list[bytes]:
    """Complete lines (hex keys) of a child's acknowledgement log; a torn last line is cut off
    the file (that put was acknowledged to nobody) so the next child appends after a clean
    line."""
    import os

    if not ack.exists():
        return []
    raw = ack.read_bytes()
    cut = raw.rfind(b"\n") + 1
    if cut != len(raw):
        os.truncate(ack, cut)
    return [bytes.fromhex(line.decode()) for line in raw[:cut].splitlines()]


def run_and_kill(argv: list[str], log: Path, delay: float, wait_ready: bool = True) -> None:
    """Run a child Python process (``argv`` after the interpreter) that never exits on its
    own and SIGKILL it ``delay`` seconds after it printed ``ready`` (or, with ``wait_ready``
    False, after it was started: anywhere in its start-up). Its stderr goes to ``log``.
    Fails the test if the child did not start or exited by itself."""
    import contextlib
    import select
    import signal
    import subprocess
    import sys

    with log.open("ab") as err:
        proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=err,
                                env=child_env())
    try:
        assert proc.stdout is not None
        if wait_ready:
            ready, _, _ = select.select([proc.stdout], [], [], 60)
            line = proc.stdout.readline() if ready else b""
            assert line == b"ready\n", f"child did not start: {log.read_text()[-2000:]}"
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=delay)
        proc.send_signal(signal.SIGKILL)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    assert rc == -signal.SIGKILL, f"child exited with {rc}: {log.read_text()[-2000:]}"


def load_script(path: Path) -> Any:
    """Import a test's child script (which is also run as ``python path``) as a module, so
    the parent shares its key and payload functions."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    """Poll ``predicate()`` every 20 ms until it is true; AssertionError naming ``what``
    after ``timeout_s`` (a hang detector: callers give generous deadlines)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.02)


#: What kvpool's sdist and wheel are built from: the files a checkout's packaging reads.
DIST_SOURCES = ("pyproject.toml", "README.md", "src")


def build_dist(root: Path, work: Path) -> tuple[Path, Path]:
    """Build the sdist and the wheel of the checkout at ``root`` into ``work/dist`` and return
    (wheel, sdist). Built from a copy of its sources (no build/ or egg-info left in the
    checkout) with ``python -m build --no-isolation``: setuptools comes from the test venv,
    so no package index is needed. CalledProcessError (with the output) on a failed build."""
    import shutil
    import subprocess
    import sys

    src = work / "src-copy"
    src.mkdir(parents=True)
    for name in DIST_SOURCES:
        path = root / name
        if path.is_dir():
            shutil.copytree(path, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(path, src / name)
    dist = work / "dist"
    # the sdist is built first and the wheel from the unpacked sdist
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist),
                    str(src)], check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = dist.glob("kvpool-*.whl")
    (sdist,) = dist.glob("kvpool-*.tar.gz")
    return wheel, sdist


class ServeProcess:
    """A ``kvpool serve`` (or any) child process whose stdout a thread collects into
    ``lines``, so a child that hangs silently fails a wait instead of blocking the test run.
    Use as a context manager: on exit a child still running is killed and reaped.
    ``popen`` goes to subprocess.Popen (stdout is always a pipe; pass
    ``stderr=subprocess.STDOUT`` to collect both)."""

    def __init__(self, argv: list[str], **popen: Any) -> None:
        import subprocess
        import threading

        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, **popen)
        self.lines: list[str] = []
        stdout = self.proc.stdout
        self._reader = threading.Thread(target=lambda: self.lines.extend(stdout or ()),
                                        daemon=True)
        self._reader.start()

    def wait_line(self, text: str, timeout_s: float = 60) -> None:
        """Wait for a line containing ``text``; AssertionError with the lines so far if the
        child exits first or it does not come within ``timeout_s``."""
        wait_for(lambda: any(text in line for line in self.lines)
                 or self.proc.poll() is not None, timeout_s, f"the line {text!r}")
        assert self.proc.poll() is None, f"exited {self.proc.returncode}: {self.lines}"

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=10)


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and wait until every one of its threads is stopped (state T): kill()
    returns before the group stop reaches each thread, and a thread woken by data in that
    window could still answer. AssertionError if they are not all stopped in ``timeout``."""
    import os
    import signal
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that ended
                continue
        if states and all(s in ("T", "t") for s in states):
            return
        assert time.monotonic() < deadline, f"process {pid} not stopped: thread states {states}"
        time.sleep(0.005)


def require_extra(module: str, extra: str) -> Any:
    """Import ``module``, which kvpool's ``extra`` installs. ``make test`` and ``make unit``
    install every extra, so a missing one fails the test (a skip would hide that the router
    or events went untested); ``KVPOOL_TEST_EXTRAS=skip`` skips instead, for a venv built
    without that extra on purpose."""
    import importlib
    import os

    import pytest
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if os.environ.get("KVPOOL_TEST_EXTRAS") == "skip":
            pytest.skip(f"{module} is not installed (kvpool[{extra}]), KVPOOL_TEST_EXTRAS=skip")
        pytest.fail(f"{module} is not installed: pip install -e '.[{extra}]' (or "
                    f"KVPOOL_TEST_EXTRAS=skip to skip these tests)", pytrace=False)
        raise AssertionError from exc  # pytest.fail raised; for the type checker
