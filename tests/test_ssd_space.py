"""Opening an SSD directory on a small or failing file system (issue 9, item 4).

A real 64 MiB ext4 loop mount: a capacity larger than the free space is refused before
anything is preallocated; a preallocation that still runs out of space mid-way, or an fd limit
hit at the n-th segment file (EMFILE, in a child process with a low RLIMIT_NOFILE), leaves no
fd open and no segment file this open created, keeps the files that were there before, and
releases the lock. Before the fix such an open filled the disk and leaked 13 fds.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from kvtest import byte_namespace, payload_for

from kvpool.errors import InsufficientSpaceError, KVPoolError
from kvpool.ssd.engine import SsdEngine
from kvpool.ssd.lock import LOCK_NAME

MiB = 1 << 20
CHUNK = 4096
NS = byte_namespace(CHUNK)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A fresh 64 MiB ext4 file system (no root-reserved blocks), loop-mounted for this test
    and unmounted afterwards."""
    image, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(64 * MiB)
    try:
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True,
                       capture_output=True, timeout=60)
        subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True,
                       capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot loop-mount a scratch ext4 (needs root, mkfs.ext4, /dev/loop*): "
                    f"{exc}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False, capture_output=True, timeout=60)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def segment_files(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in path.glob("seg-*.kvs")}


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") + b"spacetst"


def put_and_close(path: Path, capacity: int, segment_size: int, n: int) -> None:
    engine = SsdEngine(path, capacity, segment_size)
    engine.put_many([(key(i), NS, payload_for(key(i), CHUNK)) for i in range(n)])
    engine.close()


def assert_intact(path: Path, capacity: int, segment_size: int, n: int) -> None:
    engine = SsdEngine(path, capacity, segment_size)
    try:
        out = np.empty(CHUNK, np.uint8)
        for i in range(n):
            assert engine.get_into(key(i), out) and np.array_equal(out,
                                                                   payload_for(key(i), CHUNK))
    finally:
        engine.close()


def test_capacity_over_free_space_is_refused_before_writing(small_fs: Path) -> None:
    d = small_fs / "ssd"
    put_and_close(d, 4 * MiB, MiB, 20)  # an earlier, smaller cache that must survive
    before_files, before_fds, free = segment_files(d), open_fds(), free_bytes(small_fs)
    with pytest.raises(InsufficientSpaceError) as refused:
        SsdEngine(d, 256 * MiB, MiB)
    err = refused.value
    assert isinstance(err, OSError) and isinstance(err, KVPoolError)
    assert err.errno == errno.ENOSPC and err.filename == str(d)
    message = str(err)
    # how much is needed (252 missing segments) and free, and which keys to change
    assert f"{252 * MiB} bytes" in message and "free" in message
    assert "ssd.capacity" in message and "ssd.path" in message and "cache_dir" in message
    assert segment_files(d) == before_files  # nothing created, nothing removed
    assert open_fds() == before_fds
    assert free_bytes(small_fs) == free  # not one block preallocated
    assert_intact(d, 4 * MiB, MiB, 20)  # the lock was released; the old data is there


def test_running_out_of_space_mid_way_removes_what_this_open_created(small_fs: Path) -> None:
    """A real mid-way ENOSPC: reopening with twice the segment size keeps the first half of
    the old files (extended in place) and removes the second half, which the free-space check
    counts as space their removal frees; but another process still holds them open, so
    removing them frees nothing and posix_fallocate fails part-way through the extensions."""
    d = small_fs / "ssd"
    old_capacity = (free_bytes(small_fs) - 4 * MiB) // (2 * MiB) * (2 * MiB)
    put_and_close(d, old_capacity, MiB, 10)
    count = old_capacity // (2 * MiB)
    kept = {f"seg-{i:05d}.kvs" for i in range(count)}
    holder = subprocess.Popen(
        [sys.executable, "-c", "import os, sys; fds = [os.open(p, os.O_RDONLY) for p in "
         "sys.argv[1:]]; print('held', flush=True); sys.stdin.read()",
         *map(str, sorted(d.glob("seg-*.kvs")))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        before_fds = open_fds()
        with pytest.raises(InsufficientSpaceError) as refused:
            SsdEngine(d, old_capacity, 2 * MiB)
        assert "ran out of space preallocating seg-" in str(refused.value)
        assert isinstance(refused.value.__cause__, OSError)
        assert refused.value.__cause__.errno == errno.ENOSPC
        # the files beyond the new count went; the ones in range are kept (they existed
        # before this open); no file was created
        assert set(segment_files(d)) == kept
        assert sorted(p.name for p in d.iterdir()) == sorted([*kept, LOCK_NAME])
        assert open_fds() == before_fds
    finally:
        holder.kill()
        holder.wait(60)
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.close()
        holder.stdout.close()
    # The held files are gone for good now; the same open fits and the lock is free.
    engine = SsdEngine(d, old_capacity, 2 * MiB)
    assert engine.stats()["segments"] == count
    engine.close()


EMFILE_CHILD = r"""
import json, os, resource, sys
from pathlib import Path
from kvpool.ssd.engine import SsdEngine
d, cap, seg = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
before = sorted(os.listdir("/proc/self/fd"), key=int)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
# room for the lock and a few segment files, not for all of them
resource.setrlimit(resource.RLIMIT_NOFILE, (max(map(int, before)) + 6, hard))
try:
    SsdEngine(d, cap, seg).close()
    result = {"error": None}
except OSError as exc:
    result = {"error": exc.errno, "message": str(exc)}
after = sorted(os.listdir("/proc/self/fd"), key=int)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
result.update(before=before, after=after,
              files=sorted(p.name for p in d.iterdir()))
# the lock was released: this process can open the directory again at once
SsdEngine(d, 4 * seg, seg).close()
print(json.dumps(result))
"""


def test_fd_limit_mid_way_leaves_no_fd_and_no_new_file(tmp_path: Path) -> None:
    d = tmp_path / "ssd"
    put_and_close(d, 4 * MiB, MiB, 20)  # four segment files with data, kept whatever happens
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-c", EMFILE_CHILD, str(d), str(32 * MiB), str(MiB)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["error"] == errno.EMFILE, result
    assert result["after"] == result["before"]
    assert result["files"] == [LOCK_NAME] + [f"seg-{i:05d}.kvs" for i in range(4)]
    assert_intact(d, 4 * MiB, MiB, 20)
