"""One owner per SSD medium: an exclusive, non-blocking ``flock``.

Two engines writing one segment log overwrite each other's records (each believes it owns the
head), so a second opener must be refused, not served. The lock is a BSD ``flock`` because it
belongs to the open file description: a second open in the *same* process conflicts too
(POSIX ``fcntl`` locks would not), and the kernel drops it when the holder dies, even by
SIGKILL, so no stale lock ever blocks the next open. The pid written into a lock file is just
text for the error message; it is never trusted for locking.

- A directory is locked through ``<dir>/LOCK``, which holds ``"<pid> <host>"`` of the holder,
  written after the lock is taken. The file stays when the engine closes (removing it would
  race with an opener that has it open but not yet locked).
- A raw region (block device or existing file) is locked on its own inode: the lock fd is a
  separate read-only open of the device or file. Linux supports flock on block devices (udev
  uses the same convention and takes a brief shared lock while it probes a new device, hence
  the short retry for devices). The holder's pid comes from ``/proc/locks``.

Locks are advisory and local: they protect against other kvpool engines, not against other
programs writing the device, and on NFS they are per process (two engines in one process are
then not told apart). A process that forks keeps the lock held in the child until the child
closes the inherited fd or exits, or the parent calls ``release()``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import time
from pathlib import Path

from kvpool.errors import CacheDirLockedError

LOCK_NAME = "LOCK"
# udev holds LOCK_SH on a block device only while it probes it (milliseconds).
_DEVICE_RETRIES = 10
_DEVICE_RETRY_S = 0.1


class MediaLock:
    """A held lock. ``release()`` is idempotent; the kernel releases it if the process dies."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            # Unlock explicitly: a forked child sharing the fd would otherwise keep it held.
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def lock_directory(path: Path) -> MediaLock:
    """Take ``<path>/LOCK`` (created if missing). Raises CacheDirLockedError if another engine
    holds it, OSError if the file cannot be created."""
    lock_path = path / LOCK_NAME
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        if not _try_flock(fd):
            pid, host = _holder(fd, lock_path)
            raise _locked(path, pid, host)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return MediaLock(fd, lock_path)


def lock_region(path: Path) -> MediaLock:
    """Lock a block device or an existing file on its own inode. Raises CacheDirLockedError if
    another engine holds it, OSError if it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        retries = _DEVICE_RETRIES if stat.S_ISBLK(os.fstat(fd).st_mode) else 0
        while not _try_flock(fd):
            pid, host = _holder(fd, None)
            if retries == 0 or pid is not None:
                raise _locked(path, pid, host)
            retries -= 1  # no exclusive holder listed: a transient shared lock (udev probe)
            time.sleep(_DEVICE_RETRY_S)
    except BaseException:
        os.close(fd)
        raise
    return MediaLock(fd, path)


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _holder(fd: int, lock_path: Path | None) -> tuple[int | None, str | None]:
    """(pid, host) of the exclusive holder: the kernel's word from /proc/locks first (it cannot
    be stale), else what the holder wrote into the lock file (the host, and the pid where
    /proc/locks does not show it, e.g. another host on a network file system)."""
    pid = _pid_from_proc_locks(fd)
    if lock_path is not None:
        with contextlib.suppress(OSError, ValueError):
            fields = lock_path.read_text().split()
            # The text may still be the previous holder's (the new one writes it just after
            # locking): its host is only used when its pid is the holder's.
            if fields and (pid is None or int(fields[0]) == pid):
                return int(fields[0]), fields[1] if len(fields) > 1 else None
    return pid, None


def _pid_from_proc_locks(fd: int) -> int | None:
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with contextlib.suppress(OSError), open("/proc/locks") as locks:
        for line in locks:
            # "1: FLOCK  ADVISORY  WRITE 1234 08:02:131 0 EOF" ("->" marks waiters)
            fields = line.split()
            if len(fields) >= 6 and fields[1] == "FLOCK" and fields[3] == "WRITE" \
                        and fields[5] == inode and fields[4].isdigit():
                return int(fields[4]) or None  # 0: a holder outside our pid namespace
    return None


def _locked(path: Path, pid: int | None, host: str | None) -> CacheDirLockedError:
    if pid is None:
        who = "another kvpool SSD engine (pid unknown)"
    elif pid == os.getpid():
        who = f"another SSD engine in this process (pid {pid})"
    else:
        who = f"another kvpool SSD engine, pid {pid}" + (f" on {host}" if host else "")
    err = CacheDirLockedError(
        errno.EWOULDBLOCK,
        f"{path} is in use by {who}; an SSD directory or device has exactly one owner. "
        f"Either give this engine its own cache_dir (or ssd.path), or let the engines share one "
        f"pool through a local `kvpool serve` node (README: 'Two engines on one host'; "
        f"docs/cluster.md)",
        str(path))
    err.holder_pid = pid
    return err
