"""What a host pool tells routers (docs/routing.md): one KV event publisher for every
tenant's pool, and the query API answered from the pool of the request's tenant.

- Events: one PUB and one replay socket (the ``events`` section; on unless
  ``events.enabled: false``), one incarnation per host-pool start. The tenant pools start
  none of their own; each one's DRAM (``CPU``) and SSD (``DISK``) tiers are attached to the
  one publisher. With several tenants (``server.auth``) every event names its tenant
  (``tenant``); with one, none does. Keys are the chunk keys themselves (``key_scope: ""``).
- Query: ``tenant_id`` picks the tenant's pool. Without ``server.auth`` there is one pool
  and every ``tenant_id`` (or none) is answered from it, under the ``tenant_id`` asked.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

from kvpool.errors import PoolClosedError
from kvpool.events.attach import attach, open_publisher
from kvpool.host.tenants import SHARED_TENANT, Tenants
from kvpool.server.query import PoolFor, QueryError, QueryService

if TYPE_CHECKING:
    from kvpool.config import Config
    from kvpool.events.publisher import EventPublisher
    from kvpool.pool import KVPool


def host_name(config: Config) -> str:
    """Who holds the chunks, in every batch and every query answer: ``events.node_id``,
    else this host's name."""
    return config.events.node_id or socket.gethostname()


def start_host_events(config: Config, tenants: Tenants) -> EventPublisher | None:
    """The host pool's publisher, bound on ``events.host`` (unset: ``server.host``) and
    attached to every tenant's pool; None when ``events.enabled`` is false or pyzmq /
    msgspec are missing (one warning). Raises zmq.ZMQError when a port cannot be bound."""
    ev = config.events
    if ev.enabled is False:
        return None
    publisher = open_publisher(ev, host_name(config), ev.host or config.server.host,
                               advertise=config.server.advertise_host)
    if publisher is not None:
        for tenant in tenants.pools():
            attach(tenant.pool, publisher, None if tenant.name == SHARED_TENANT else tenant.name)
    return publisher


def tenant_pools(tenants: Tenants) -> PoolFor:
    """The query API's pool for a ``tenant_id``: the one pool without ``server.auth``, else
    that tenant's; QueryError naming an unknown tenant, PoolClosedError once stopping."""

    def pool_for(tenant_id: str) -> KVPool:
        pools = {t.name: t.pool for t in tenants.pools()}
        if not pools:
            raise PoolClosedError("the host pool is stopping")
        if SHARED_TENANT in pools:
            return pools[SHARED_TENANT]
        found = pools.get(tenant_id)
        if found is None:
            raise QueryError(f"unknown tenant {tenant_id!r}: give tenant_id, one of "
                             f"{', '.join(sorted(pools))}")
        return found

    return pool_for


def host_query(config: Config, tenants: Tenants,
               publisher: EventPublisher | None) -> QueryService:
    """``/query`` and ``/query_by_hash`` of a host pool: local answers only (it follows no
    cluster membership: ``scope: cluster`` is a 400), with the publisher's incarnation."""
    return QueryService(tenant_pools(tenants), host_name(config),
                        lambda: publisher.incarnation if publisher is not None else None,
                        None, frozenset, config.query.timeout_s)
