"""kvpool: a native, tiered, distributed KV-cache store for LLM inference."""

from kvpool.config import Config, load_config
from kvpool.errors import (
    ArgumentError,
    CacheDirLockedError,
    ChunkSizeError,
    ConfigError,
    InsufficientSpaceError,
    KVPoolError,
    PoolClosedError,
    UnknownNamespaceError,
)
from kvpool.host import open_pool
from kvpool.keys import KVLayout, Namespace, chunk_keys
from kvpool.pool import KVPool

__version__ = "0.1.0"

__all__ = [
    "ArgumentError",
    "CacheDirLockedError",
    "ChunkSizeError",
    "Config",
    "ConfigError",
    "InsufficientSpaceError",
    "KVLayout",
    "KVPool",
    "KVPoolError",
    "Namespace",
    "PoolClosedError",
    "UnknownNamespaceError",
    "__version__",
    "chunk_keys",
    "load_config",
    "open_pool",
]
