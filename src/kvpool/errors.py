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
