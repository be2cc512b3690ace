"""A node's stable identity (kept in its cache_dir) and its per-run incarnation id.

The identity tells a node's own earlier run (same cache_dir, e.g. restarted after kill -9
before its lease ran out) from another node started with the same ``server.node_id``
(:mod:`kvpool.cluster.registration` only takes over a key that names its own identity). One
identity must be one process at a time: a node holds :func:`hold_identity`'s lock (an
exclusive ``flock`` on ``<cache_dir>/node-identity.lock``, dropped by the kernel when the
process dies) for as long as it runs, so two nodes sharing a cache_dir (with separate
``ssd.path``: the SSD lock would not tell them apart) are refused too.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
from pathlib import Path

__all__ = ["IDENTITY_FILE", "IdentityLock", "cache_dir_identity", "hold_identity",
           "new_identity", "new_incarnation"]

IDENTITY_FILE = "node-identity"
_FORMAT = re.compile(r"^[0-9a-f]{32}$")


def new_identity() -> str:
    """A fresh random identity (32 hex digits)."""
    return secrets.token_hex(16)


def new_incarnation() -> str:
    """A fresh random incarnation id (16 hex digits), one per process start."""
    return secrets.token_hex(8)


def cache_dir_identity(cache_dir: str | Path) -> str:
    """The identity kept in ``<cache_dir>/node-identity``, written (atomically, once) on first
    use. Two processes creating it at once agree on one. Raises OSError if the directory or
    file cannot be created or read, ValueError if the file holds something else than an
    identity (it is never overwritten: a node must not silently change identity)."""
    directory = Path(cache_dir).expanduser()
    path = directory / IDENTITY_FILE
    with contextlib.suppress(FileNotFoundError):
        return _read(path)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{IDENTITY_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        with open(tmp, "w", encoding="ascii") as f:
            f.write(new_identity() + "\n")
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):  # another process won: use its identity
            os.link(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return _read(path)


def _read(path: Path) -> str:
    text = path.read_text(encoding="ascii", errors="replace").strip()
    if not _FORMAT.match(text):
        raise ValueError(f"{path}: not a kvpool node identity ({text[:40]!r}); move it away "
                         "to give this cache_dir a new identity")
    return text


class IdentityLock:
    """The held lock of one cache_dir identity; :meth:`release` (idempotent) drops it."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def hold_identity(cache_dir: str | Path) -> tuple[str, IdentityLock]:
    """:func:`cache_dir_identity`, and its lock held until released (or the process exits).
    Raises BlockingIOError naming the lock file when another process (or another node in
    this one) holds it, and as cache_dir_identity otherwise."""
    identity = cache_dir_identity(cache_dir)
    path = Path(cache_dir).expanduser() / f"{IDENTITY_FILE}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise BlockingIOError(f"{path} is held by another running node: its cache_dir "
                              "identity is in use") from None
    except BaseException:
        os.close(fd)
        raise
    return identity, IdentityLock(fd)
