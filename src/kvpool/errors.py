"""Typed exceptions. Misses are values (False / 0), never exceptions; these are for misuse."""


class KVPoolError(Exception):
    """Base class of every error kvpool raises on purpose."""


class ConfigError(KVPoolError, ValueError):
    """A config file, value or environment override is invalid; the message names the key."""


class ChunkSizeError(KVPoolError, ValueError):
    """A buffer's size does not match the namespace's chunk size."""


class UnknownNamespaceError(KVPoolError, KeyError):
    """An operation named a namespace that was never registered with the pool."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown namespace"


class PoolClosedError(KVPoolError, RuntimeError):
    """The pool (or tier) was closed; no further operations are accepted."""


class CorruptRecordError(KVPoolError):
    """A record header or payload failed validation. Tiers turn this into a counted miss."""


class ArgumentError(KVPoolError, TypeError, ValueError):
    """A call got an argument of the wrong type or shape (a key that is not 16 bytes, a
    namespace that is not a Namespace, ...); the message names the argument."""


class _MediaOSError(KVPoolError, OSError):
    """An OSError kvpool raises on purpose about its SSD media: ``errno`` and ``filename`` are
    set, ``str()`` is just the message (no ``[Errno N]`` prefix: the message says it all)."""

    def __str__(self) -> str:
        return str(self.strerror)


class CacheDirLockedError(_MediaOSError):
    """Another SSD engine, in this process or another, holds the SSD directory or raw region
    (errno EWOULDBLOCK, ``filename`` the path). ``holder_pid`` is the holder's pid when it can
    be found, else None. The message names both ways out: another ``cache_dir``/``ssd.path``,
    or one shared pool behind a local ``kvpool serve`` node."""

    holder_pid: int | None = None


class InsufficientSpaceError(_MediaOSError):
    """The SSD capacity does not fit in the free space of its file system (errno ENOSPC,
    ``filename`` the directory). Raised before anything is preallocated, or when preallocation
    still runs out (another writer, file system metadata) after every file this open created
    was removed. The message gives the bytes needed and free and the keys to change."""


class PinLimitError(KVPoolError, ValueError):
    """A save asked to pin chunks past ``pool.max_pinned_fraction`` of DRAM (locally, or on a
    storage node, whose answer has status PIN_LIMIT); nothing of that save was pinned."""
