"""One owner per SSD directory or raw region (issue 9, item 2).

Real processes on real files: a second opener, in another process or in this one, is refused
with CacheDirLockedError naming the holder's pid and the two ways out; a SIGKILLed holder
leaves no lock behind, and its data is intact. Before the lock, two processes writing 1,000
chunks each into one cache dir lost about half of them on reopen.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from kvtest import byte_namespace, payload_for
from ssd_lock_child import CHUNK, key_of

from kvpool import KVPool, load_config
from kvpool.errors import CacheDirLockedError, KVPoolError
from kvpool.ssd.engine import SsdEngine
from kvpool.ssd.lock import LOCK_NAME

MiB = 1 << 20
CHILD = Path(__file__).with_name("ssd_lock_child.py")
NS = byte_namespace(CHUNK)


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


class Child:
    """One ssd_lock_child.py process; stopped by its own pid at the end."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, str(CHILD), *args], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env or child_env())
        assert self.proc.stdout is not None
        self.first = self.proc.stdout.readline().split()

    def line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def wait_written(self) -> None:
        assert self.first[0] == "ready", (self.first, self.finish())
        assert self.line().startswith("wrote")

    def close(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write("close\n")
        self.proc.stdin.flush()
        return self.proc.wait(60)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(60)

    def finish(self) -> str:
        """Wait for exit; return the rest of stdout and stderr (read through the same text
        streams as the first line: communicate() would miss what they already buffered)."""
        assert self.proc.stdin and self.proc.stdout and self.proc.stderr
        self.proc.stdin.close()
        self.proc.wait(60)
        return self.proc.stdout.read() + self.proc.stderr.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for child in started:
        child.stop()


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def assert_refused_by(child: Child, holder_pid: int, path: Path) -> str:
    """The child exited 2 with an error naming path, the holder and both ways out."""
    assert child.first == ["locked", str(holder_pid)], (child.first, child.finish())
    message = child.finish()
    assert child.proc.returncode == 2
    for part in (str(path), f"pid {holder_pid}", "cache_dir", "ssd.path", "kvpool serve"):
        assert part in message, (part, message)
    return message


def assert_chunks(engine: SsdEngine, salt: str, count: int) -> None:
    out = np.empty(CHUNK, np.uint8)
    for i in range(count):
        k = key_of(salt, i)
        assert engine.get_into(k, out), (salt, i)
        assert np.array_equal(out, payload_for(k, CHUNK)), (salt, i)


def test_second_process_is_refused_and_a_killed_holder_leaves_no_lock(
        tmp_path: Path, children: list[Child]) -> None:
    d = tmp_path / "ssd"
    holder = Child("engine", str(d), str(4 * MiB), str(MiB), "100", "a")
    children.append(holder)
    holder.wait_written()
    assert (d / LOCK_NAME).read_text().split()[0] == str(holder.proc.pid)
    second = Child("engine", str(d), str(4 * MiB), str(MiB), "10", "b")
    children.append(second)
    assert_refused_by(second, holder.proc.pid, d)
    holder.kill()
    # The pid in LOCK is now stale text; it does not block the next owner.
    assert (d / LOCK_NAME).read_text().split()[0] == str(holder.proc.pid)
    engine = SsdEngine(d, 4 * MiB, MiB)
    try:
        assert len(engine) == 100
        assert_chunks(engine, "a", 100)
        assert (d / LOCK_NAME).read_text().split()[0] == str(os.getpid())
    finally:
        engine.close()


def test_second_engine_in_this_process_is_refused(tmp_path: Path) -> None:
    first = SsdEngine(tmp_path, 4 * MiB, MiB)
    k = key_of("in", 1)
    first.put(k, NS, payload_for(k, CHUNK))
    before = open_fds()
    with pytest.raises(CacheDirLockedError) as refused:
        SsdEngine(tmp_path, 4 * MiB, MiB)
    err = refused.value
    assert isinstance(err, OSError) and isinstance(err, KVPoolError)
    assert err.holder_pid == os.getpid() and err.filename == str(tmp_path)
    assert "this process" in str(err) and "kvpool serve" in str(err)
    assert open_fds() == before  # the refused open holds nothing
    out = np.empty(CHUNK, np.uint8)
    assert first.get_into(k, out) and np.array_equal(out, payload_for(k, CHUNK))
    first.close()
    again = SsdEngine(tmp_path, 4 * MiB, MiB)  # close() released the lock
    assert again.get_into(k, out) and np.array_equal(out, payload_for(k, CHUNK))
    again.close()


def test_second_pool_in_this_process_is_refused(tmp_path: Path) -> None:
    """Two embedded pools on one cache_dir: the second fails at KVPool(), not with lost data."""
    cfg = load_config(overrides={"cache_dir": str(tmp_path), "dram": {"capacity": 0},
                                 "ssd": {"capacity": "4MiB", "segment_size": "1MiB"}})
    pool = KVPool(cfg)
    with pytest.raises(CacheDirLockedError, match="kvpool serve"):
        KVPool(cfg)
    pool.close()
    KVPool(cfg).close()


def test_raw_file_region_is_locked(tmp_path: Path, children: list[Child]) -> None:
    region = tmp_path / "region"
    with open(region, "wb") as f:
        f.truncate(4 * MiB)
    engine = SsdEngine(region, 4 * MiB, MiB)
    k = key_of("raw", 1)
    engine.put(k, NS, payload_for(k, CHUNK))
    with pytest.raises(CacheDirLockedError) as refused:
        SsdEngine(region, 4 * MiB, MiB)
    assert refused.value.holder_pid == os.getpid()  # from /proc/locks: no lock file here
    other = Child("engine", str(region), str(4 * MiB), str(MiB), "1", "x")
    children.append(other)
    assert_refused_by(other, os.getpid(), region)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["region"]  # no sibling files
    engine.close()
    engine = SsdEngine(region, 4 * MiB, MiB)
    out = np.empty(CHUNK, np.uint8)
    assert engine.get_into(k, out) and np.array_equal(out, payload_for(k, CHUNK))
    engine.close()


@pytest.fixture
def loop_device(tmp_path: Path) -> Iterator[Path]:
    """A real block device (a loop device over an 8 MiB file), detached afterwards."""
    image = tmp_path / "device.img"
    with open(image, "wb") as f:
        f.truncate(8 * MiB)
    try:
        found = subprocess.run(["losetup", "--find", "--show", str(image)], check=True,
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot attach a loop device (needs root and /dev/loop*): {exc}")
    device = Path(found.stdout.strip())
    yield device
    subprocess.run(["losetup", "--detach", str(device)], check=False, timeout=30)


def test_block_device_is_locked(loop_device: Path, children: list[Child]) -> None:
    engine = SsdEngine(loop_device, 8 * MiB, MiB)
    k = key_of("dev", 1)
    engine.put(k, NS, payload_for(k, CHUNK))
    other = Child("engine", str(loop_device), str(8 * MiB), str(MiB), "1", "y")
    children.append(other)
    assert_refused_by(other, os.getpid(), loop_device)
    engine.close()
    holder = Child("engine", str(loop_device), str(8 * MiB), str(MiB), "5", "z")
    children.append(holder)
    holder.wait_written()
    with pytest.raises(CacheDirLockedError) as refused:
        SsdEngine(loop_device, 8 * MiB, MiB)
    assert refused.value.holder_pid == holder.proc.pid
    holder.kill()
    engine = SsdEngine(loop_device, 8 * MiB, MiB)
    try:
        assert_chunks(engine, "z", 5)
        out = np.empty(CHUNK, np.uint8)
        assert engine.get_into(k, out) and np.array_equal(out, payload_for(k, CHUNK))
    finally:
        engine.close()


def test_two_pools_on_the_default_cache_dir(tmp_path: Path, children: list[Child]) -> None:
    """The issue's scenario: two processes, each an embedded KVPool() on the default cache
    dir, 1,000 chunks each. Without the lock both opened and ~50% of each one's chunks were
    gone after reopen; now the second is refused at open and the first keeps all 1,000."""
    env = child_env(XDG_CACHE_HOME=str(tmp_path / "xdg"), KVPOOL_DRAM__CAPACITY="0",
                    KVPOOL_SSD__CAPACITY="32MiB", KVPOOL_SSD__SEGMENT_SIZE="4MiB")
    first = Child("pool", "1000", "one", env=env)
    children.append(first)
    second = Child("pool", "1000", "two", env=env)
    children.append(second)
    assert_refused_by(second, first.proc.pid, tmp_path / "xdg" / "kvpool" / "ssd")
    first.wait_written()
    assert first.close() == 0
    engine = SsdEngine(tmp_path / "xdg" / "kvpool" / "ssd", 32 * MiB, 4 * MiB)
    try:
        assert len(engine) == 1000
        assert_chunks(engine, "one", 1000)
    finally:
        engine.close()
