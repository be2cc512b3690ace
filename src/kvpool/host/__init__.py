"""One pool per host: ``kvpool host`` (server.py) owns each tenant's DRAM arena, a
shared-memory file, and the SSD; engine processes attach (client.py) over a Unix socket,
map the arena, and move bytes only between their memory and it.

``open_pool(config)`` is the one place an engine chooses: attached when ``host.socket`` is
set, else the embedded KVPool (the default).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.config import Config, load_config

if TYPE_CHECKING:
    from kvpool.host.client import AttachedPool
    from kvpool.pool import KVPool


def open_pool(config: Config | None = None) -> KVPool | AttachedPool:
    """An AttachedPool when ``config.host.socket`` is set, else ``KVPool(config)``; the same
    API either way. Raises as their constructors do."""
    cfg = config if config is not None else load_config()
    if cfg.host.socket:
        from kvpool.host.client import AttachedPool
        return AttachedPool(cfg)
    from kvpool.pool import KVPool
    return KVPool(cfg)
