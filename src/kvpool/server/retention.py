"""RETAIN and RELEASE on a storage node (net/protocol.py; docs/retention.md).

A node keeps its clients' retention in its own pool's book (retention/book.py), filed under
the scoped keys of its store, so pins, priorities and TTLs steer its own DRAM evictions and
its reads exactly as in an embedded pool; its tenants' quotas are its pool's
(``pool.tenant_quotas`` in the node's config). A session is scoped by the namespace's tenant:
one tenant's RELEASE never ends another's session of the same name.

Failure contract: a malformed retention is refused BAD_REQUEST; pins past the node's
``pool.max_pinned_fraction`` are refused PIN_LIMIT with nothing recorded; an undeclared
namespace UNKNOWN_NAMESPACE (server/store.py ``Refused``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import Executor
from dataclasses import replace

from kvpool.errors import ArgumentError, PinLimitError, PoolClosedError
from kvpool.net.protocol import NS_BYTES, ProtocolError, Status, split_retain
from kvpool.pool import KVPool
from kvpool.retention import Retention
from kvpool.server.store import NodeStore, Refused, Session

log = logging.getLogger("kvpool.serve")


async def expire_due(pool: KVPool, executor: Executor | None = None) -> None:
    """Remove the chunks whose TTL passed from every tier (``KVPool.expire``, which may wait
    on the SSD) on ``executor`` (None: the loop's default executor); costs a length check
    while no save asked for retention. A failure is logged; the expired chunks stay misses
    and the next round tries again."""
    if not len(pool.retention) and not pool.retention.any_expired:
        return
    try:
        await asyncio.get_running_loop().run_in_executor(executor, pool.expire)
    except PoolClosedError:
        return  # the node is stopping
    except Exception:
        log.exception("expiring chunks whose retention TTL passed failed")


def tenant_session(tenant: str, session: str) -> str:
    """The name a node files a client's session under: scoped by its tenant."""
    return f"{tenant}\x00{session}"


def retain(store: NodeStore, session: Session, meta: bytes | memoryview, count: int) -> int:
    """RETAIN: record the retention for the keys (stored or still to come); the keys
    recorded. In memory only (the book's lock), so it runs on the event loop."""
    ns_id, keys, raw = split_retain(meta, count)
    ns, scoped = store._scoped(session, ns_id, keys)
    try:
        retention = Retention.from_mapping(raw)
    except ArgumentError as exc:
        raise Refused(Status.BAD_REQUEST, f"bad retention: {exc}") from None
    if retention.session is not None:
        retention = replace(retention, session=tenant_session(ns.tenant, retention.session))
    try:
        store.pool.retain(ns, scoped, retention)
    except PinLimitError as exc:
        store.counters.add("pins_refused")
        raise Refused(Status.PIN_LIMIT, str(exc)) from None
    store.counters.add("retained_chunks", len(scoped))
    return len(scoped)


def release(store: NodeStore, session: Session, meta: bytes | memoryview) -> int:
    """RELEASE: end a session of the namespace's tenant (deleting its chunks with
    ``delete``); the chunks released. Deletion may wait on the SSD: it runs on the
    connection's own thread, like every op (server/connection.py)."""
    if len(meta) <= NS_BYTES:
        raise ProtocolError("RELEASE metadata must be a namespace id and a JSON object")
    ns = store._namespace_of(session, bytes(meta[:NS_BYTES]))
    try:
        doc = json.loads(bytes(meta[NS_BYTES:]))
        name, delete = doc["session"], doc.get("delete", False)
        if not isinstance(name, str) or not name or not isinstance(delete, bool):
            raise ValueError("session must be a non-empty string, delete a boolean")
    except (ValueError, KeyError, TypeError) as exc:
        raise Refused(Status.BAD_REQUEST, f"bad RELEASE: {exc}") from None
    released: int = store.pool.release(tenant_session(ns.tenant, name), delete)
    store.counters.add("released_chunks", released)
    return released
