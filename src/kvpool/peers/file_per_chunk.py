"""A file-per-chunk store: the file-system approach kvpool's SSD engine replaces.

Used as a benchmark peer (``kvpool bench storage``) and as a simple test oracle. Every chunk is
one regular file named by its key's hex digest under a two-level fan-out directory
(``ab/cd/abcd...``), which is how several KV-cache offloaders keep chunks on local disk.

Writes go to a temporary file in the chunk's directory and are published with ``os.replace``,
so a reader sees either no chunk or the whole chunk, never a partial one. With
``durable=True`` the file is ``fsync``-ed before the rename (the directory entry itself is not
fsync-ed: after a crash a chunk may be missing, but a present chunk is complete).

Keys are immutable content addresses, so a second ``put`` of a key simply replaces the file with
identical bytes. The store is safe to use from several threads: temporary names are unique per
process and thread, and publishing is atomic.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

from kvpool.errors import PoolClosedError

_TMP_SUFFIX = ".tmp"


class FilePerChunkStore:
    """One file per chunk under ``directory``.

    ``directory`` is created (with parents) if it does not exist; OSError is raised if that
    fails. Misses and IO failures during operations are reported as ``False``, never raised;
    misuse (a closed store, a key that is not bytes of at least 2 bytes, a read-only output
    buffer) raises.
    """

    def __init__(self, directory: str | os.PathLike[str], durable: bool = False) -> None:
        self.directory = Path(directory)
        self.durable = durable
        self.directory.mkdir(parents=True, exist_ok=True)
        self._made_dirs: set[str] = set()
        self._lock = threading.Lock()
        self._closed = False

    # -- paths ------------------------------------------------------------------------------

    def _check(self, key: bytes) -> str:
        if self._closed:
            raise PoolClosedError("FilePerChunkStore is closed")
        if not isinstance(key, bytes | bytearray) or len(key) < 2:
            raise ValueError(f"key must be bytes of length >= 2, got {key!r:.40}")
        return bytes(key).hex()

    def _dir_of(self, hexkey: str) -> str:
        return os.path.join(self.directory, hexkey[0:2], hexkey[2:4])

    def path_of(self, key: bytes) -> Path:
        """Where ``key``'s chunk lives (whether or not it exists)."""
        hexkey = self._check(key)
        return Path(self._dir_of(hexkey)) / hexkey

    # -- operations -------------------------------------------------------------------------

    def put(self, key: bytes, data: Any) -> bool:
        """Store ``data`` (any C-contiguous buffer) as ``key``'s chunk; True once published.

        Returns False if any file operation fails (e.g. a full disk or a permission error); the
        temporary file is removed and any earlier chunk of that key is left as it was. Raises
        TypeError if ``data`` is not a contiguous buffer, ValueError for a bad key and
        PoolClosedError after ``close()``.
        """
        hexkey = self._check(key)
        with memoryview(data) as view:
            if not view.c_contiguous:
                raise TypeError("data must be a C-contiguous buffer")
            flat = view.cast("B") if view.format != "B" or view.ndim != 1 else view
            d = self._dir_of(hexkey)
            final = os.path.join(d, hexkey)
            tmp = f"{final}.{os.getpid()}.{threading.get_ident()}{_TMP_SUFFIX}"
            try:
                if d not in self._made_dirs:
                    os.makedirs(d, exist_ok=True)
                    with self._lock:
                        self._made_dirs.add(d)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    done = 0
                    total = len(flat)
                    while done < total:
                        n = os.write(fd, flat[done:])
                        if n <= 0:
                            raise OSError("short write")
                        done += n
                    if self.durable:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, final)
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                return False
            return True

    def get_into(self, key: bytes, out: Any) -> bool:
        """Read ``key``'s chunk into the writable buffer ``out``; True if ``out`` now holds it.

        Returns False when the chunk is missing, when its size differs from ``len(out)`` (``out``
        is then untouched), or when reading fails (``out`` may then hold partial data). Raises
        TypeError if ``out`` is not a writable contiguous buffer, ValueError for a bad key and
        PoolClosedError after ``close()``.
        """
        hexkey = self._check(key)
        with memoryview(out) as view:
            if view.readonly or not view.c_contiguous:
                raise TypeError("out must be a writable C-contiguous buffer")
            flat = view.cast("B") if view.format != "B" or view.ndim != 1 else view
            try:
                fd = os.open(os.path.join(self._dir_of(hexkey), hexkey), os.O_RDONLY)
            except OSError:
                return False
            try:
                total = len(flat)
                if os.fstat(fd).st_size != total:
                    return False
                done = 0
                while done < total:
                    n = os.readv(fd, [flat[done:]])
                    if n <= 0:
                        return False  # truncated underneath us
                    done += n
                return True
            except OSError:
                return False
            finally:
                os.close(fd)

    def contains(self, key: bytes) -> bool:
        """True if ``key``'s chunk file exists. Raises as ``get_into`` does for misuse."""
        hexkey = self._check(key)
        return os.path.isfile(os.path.join(self._dir_of(hexkey), hexkey))

    def delete(self, key: bytes) -> bool:
        """Remove ``key``'s chunk; True if a file was removed, False if missing or not removable.

        Raises as ``get_into`` does for misuse.
        """
        hexkey = self._check(key)
        try:
            os.unlink(os.path.join(self._dir_of(hexkey), hexkey))
        except OSError:
            return False
        return True

    def _files(self) -> list[str]:
        files: list[str] = []
        for root, _dirs, names in os.walk(self.directory):
            files.extend(os.path.join(root, n) for n in names if not n.endswith(_TMP_SUFFIX))
        return files

    def __len__(self) -> int:
        """Number of chunk files (walks the directory tree: O(files))."""
        return len(self._files())

    def drop_page_cache(self) -> None:
        """Evict every chunk file's pages from the OS page cache (no root needed).

        Dirty pages cannot be dropped, so ``os.sync()`` writes back all dirty data first; then
        ``posix_fadvise(POSIX_FADV_DONTNEED)`` is applied to each file. Files that vanish or
        cannot be opened meanwhile are skipped. A no-op where ``posix_fadvise`` is unavailable.
        Raises PoolClosedError after ``close()``.
        """
        if self._closed:
            raise PoolClosedError("FilePerChunkStore is closed")
        fadvise = getattr(os, "posix_fadvise", None)
        if fadvise is None:
            return
        os.sync()
        for path in self._files():
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            finally:
                os.close(fd)

    def clear(self) -> None:
        """Delete every chunk (and the fan-out directories); the store stays usable.

        Raises OSError if something under the directory cannot be removed, PoolClosedError
        after ``close()``.
        """
        if self._closed:
            raise PoolClosedError("FilePerChunkStore is closed")
        with self._lock:
            self._made_dirs.clear()
        for entry in os.scandir(self.directory):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)

    def close(self) -> None:
        """Stop accepting operations; the files stay on disk. Idempotent."""
        self._closed = True

    def __enter__(self) -> FilePerChunkStore:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
