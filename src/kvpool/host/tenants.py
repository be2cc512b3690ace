"""The host pool's tenants: one embedded KVPool, and so one DRAM arena, per tenant.

Why one arena per tenant: an attached engine maps its arena whole and writes into it (its
reservations), so it can read every byte of it. Isolation therefore has to be between
arenas, not between slots: a tenant's engines receive only their own tenant's arena, as a
file descriptor over the socket (SCM_RIGHTS) after the peer's uid (SO_PEERCRED) and the
tenant token checked out. Each arena file is created mode 0600 in ``host.shm_dir`` and
unlinked as soon as the host pool has opened it, so no path exists to open it by, and
nothing is left in /dev/shm when the host pool dies.

Without ``server.auth`` there is one tenant (every engine shares one arena and one SSD
directory, the config's own); with it, each tenant named in ``server.auth`` gets a pool of
its own, with the config's dram and ssd sizes (sizes are per tenant) and its SSD under
``<ssd path>/tenant-<name>``. Every pool is opened before the host pool listens (an arena's
prefault takes ~0.5 s per GiB: no attach waits for it).
"""

from __future__ import annotations

import hmac
import os
import re
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path

from kvpool.config import Config
from kvpool.errors import KVPoolError
from kvpool.pool import KVPool
from kvpool.tiers.directory import DIRECT_READS_SUPPORTED, ReadDirectory, entries_for

#: The tenant every engine belongs to when the host pool has no server.auth.
SHARED_TENANT = "*"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


class AttachRefused(KVPoolError):
    """An attach that the peer's uid or token does not allow; the message says which."""


@dataclass
class TenantPool:
    """One tenant's embedded pool, the descriptor of its arena file (unlinked), and its
    read directory (None: engines ask for every read)."""

    name: str
    pool: KVPool
    arena_fd: int
    arena_bytes: int
    directory: ReadDirectory | None = None

    def close(self) -> None:
        self.pool.close()
        os.close(self.arena_fd)


def tenant_for(config: Config, token: str | None, tenant: str) -> str:
    """The tenant an attach with ``token`` asking for ``tenant`` gets: SHARED_TENANT without
    server.auth, else ``tenant`` when a server.auth token equal to ``token`` lists it.
    Raises AttachRefused otherwise (the message never echoes the token)."""
    if not config.server.auth:
        return SHARED_TENANT
    given = (token or "").encode()
    for entry in config.server.auth:
        if hmac.compare_digest(entry.token.encode(), given) and tenant in entry.tenants:
            return tenant
    raise AttachRefused(f"token refused for tenant {tenant!r}")


def peer_allowed(config: Config, uid: int) -> bool:
    """The SO_PEERCRED check: the host pool's own uid, root, or host.allowed_uids."""
    return uid in (os.getuid(), 0) or uid in config.host.allowed_uids


class Tenants:
    """Every tenant's pool, opened at construction (raises OSError or ValueError when one
    cannot be opened, after closing those it opened); thread-safe."""

    def __init__(self, config: Config) -> None:
        if config.dram.capacity <= 0:
            raise ValueError("dram.capacity: a host pool needs a DRAM arena (set it > 0)")
        self._config = config
        self._pools: dict[str, TenantPool] = {}
        self._lock = threading.Lock()
        self._closed = False
        names = sorted({t for e in config.server.auth for t in e.tenants}) \
            if config.server.auth else [SHARED_TENANT]
        try:
            for name in names:
                self._pools[name] = self._open(name)
        except BaseException:
            self.close()
            raise

    def get(self, tenant: str) -> TenantPool:
        """The tenant's pool; KVPoolError once stopping."""
        with self._lock:
            found = self._pools.get(tenant)
            if self._closed or found is None:
                raise KVPoolError(f"no pool for tenant {tenant!r} (the host pool is stopping)")
            return found

    def _tenant_config(self, tenant: str) -> Config:
        cfg = self._config.model_copy(deep=True)
        safe = _SAFE.sub("_", tenant)
        name = f"kvpool-host-{safe}-{os.getpid()}-{secrets.token_hex(4)}"
        cfg.dram.shm_path = str(Path(cfg.host.shm_dir) / name)
        cfg.host.socket = None  # the tenant's pool is embedded here
        cfg.metrics.port = None
        if tenant != SHARED_TENANT:
            ssd = self._config.ssd_path() / f"tenant-{safe}"
            if cfg.ssd.enabled:
                ssd.mkdir(parents=True, exist_ok=True)
            cfg.ssd.path = str(ssd)
        return cfg

    def _open(self, tenant: str) -> TenantPool:
        cfg = self._tenant_config(tenant)
        path = cfg.dram.shm_path
        assert path is not None
        # the host pool publishes every tenant's events through one publisher (events.py)
        pool = KVPool(cfg, serve_metrics=False, publish_events=False)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            pool.close()
            raise
        os.unlink(path)  # from here only a descriptor reaches it
        capacity = int(pool.stats()["dram"]["capacity_bytes"])
        directory = None
        if cfg.host.direct_reads and DIRECT_READS_SUPPORTED:
            try:
                directory = ReadDirectory(cfg.host.directory_entries or entries_for(capacity))
                pool.share_directory(directory)  # the pool's DRAM tier closes it
            except BaseException:
                if directory is not None:
                    directory.close()
                os.close(fd)
                pool.close()
                raise
        return TenantPool(tenant, pool, fd, capacity, directory)

    def pools(self) -> list[TenantPool]:
        with self._lock:
            return list(self._pools.values())

    def stats(self) -> dict[str, int]:
        """Per tenant: DRAM bytes held (the slots of resident chunks)."""
        with self._lock:
            pools = list(self._pools.values())
        return {t.name: int(t.pool.stats()["dram"]["used_bytes"]) for t in pools}

    def close(self) -> None:
        """Close every tenant's pool (write-behind flushed, arenas unmapped). Idempotent."""
        with self._lock:
            self._closed = True
            pools, self._pools = list(self._pools.values()), {}
        for t in pools:
            t.close()
