"""The NodeStore without a socket: a real embedded KVPool (DRAM arena + SSD engine on
tmp_path) driven the way a connection drives it, one Session per simulated connection."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvtest import CHUNK, byte_namespace, payload_for, small_config

from kvpool.keys import Namespace
from kvpool.net.protocol import FEATURES, ProtocolError, Status
from kvpool.pool import KVPool
from kvpool.server.store import NodeStore, Refused, Session, scoped_chunk_key

TOKENS = [{"token": "token-acme-123", "tenants": ["acme"]},
          {"token": "token-beta-456", "tenants": ["beta"]}]
ADMIN = "admin-token-000"


class Store:
    """A NodeStore over a real pool."""

    def __init__(self, tmp_path: Path, **server: Any) -> None:
        # evict: the counts asserted below (invalidate's copies) are DRAM's alone, not racing
        # the write-behind to SSD
        config = small_config(tmp_path, server=server, pool={"ssd_write": "evict"})
        self.pool = KVPool(config, remote=False)
        self.store = NodeStore(self.pool, config.server, "node-under-test")

    def close(self) -> None:
        self.pool.close()

    def declare(self, session: Session, ns: Namespace) -> bytes:
        features, ns_id = self.store.declare(session, json.dumps(ns.canonical()).encode())
        assert features == FEATURES
        return ns_id

    def put(self, session: Session, ns: Namespace, keys: list[bytes]) -> tuple[int, int]:
        """PUT ``keys`` with payload_for bytes, filling the targets as a transport would.
        Returns (chunks stored, chunks that needed no receive)."""
        batch = self.store.begin_put(session, ns.id, keys, len(keys) * CHUNK)
        try:
            for key, target in zip(keys, batch.targets, strict=True):
                if target is not None:
                    target[:] = payload_for(key).tobytes()
            skipped = sum(t is None for t in batch.targets)
            return self.store.commit_put(batch), skipped
        finally:
            batch.abort()

    def get(self, session: Session, ns: Namespace, keys: list[bytes],
            touch: list[bytes] | None = None) -> list[bytes | None]:
        answer = self.store.get(session, ns.id, keys, touch or [])
        try:
            views = iter(answer.views)
            return [bytes(next(views)) if flag else None for flag in answer.flags]
        finally:
            answer.release()


@pytest.fixture
def open_store(tmp_path: Path) -> Iterator[Store]:
    store = Store(tmp_path)
    yield store
    store.close()


@pytest.fixture
def auth_store(tmp_path: Path) -> Iterator[Store]:
    store = Store(tmp_path, auth=TOKENS, admin_token=ADMIN)
    yield store
    store.close()


def keys_of(n: int, tag: bytes = b"k") -> list[bytes]:
    return [tag + i.to_bytes(16 - len(tag), "big") for i in range(n)]


def refused(fn: Any, *args: Any) -> Refused:
    with pytest.raises(Refused) as info:
        fn(*args)
    return info.value


def test_put_get_exists_touch_delete_invalidate_results(open_store: Store) -> None:
    s, store = open_store, open_store.store
    session = store.open_session()
    assert session.authenticated  # auth is off
    ns = byte_namespace()
    assert s.declare(session, ns) == ns.id
    keys = keys_of(6)
    assert s.put(session, ns, keys[:4]) == (4, 0)
    assert s.put(session, ns, keys[:4]) == (4, 4)  # already stored: nothing to receive
    got = s.get(session, ns, keys[:5])
    assert got[:4] == [payload_for(k).tobytes() for k in keys[:4]] and got[4] is None
    assert store.exists(session, ns.id, keys) == [True] * 4 + [False] * 2
    assert store.exists_prefix(session, ns.id, [keys[0], keys[1], keys[5], keys[2]]) == 2
    assert store.touch(session, ns.id, keys) == 4
    assert store.delete(session, ns.id, [keys[0], keys[5]]) == 1
    assert s.get(session, ns, [keys[0]]) == [None]
    assert store.invalidate(session, ns.id) == 3
    assert store.exists(session, ns.id, keys) == [False] * 6
    stats = store.stats(session, {"connections": 1})
    assert stats["server"]["put_chunks"] == 8
    assert stats["server"]["get_hits"] == 4 and stats["server"]["get_misses"] == 2
    assert stats["server"]["connections"] == 1 and stats["server"]["namespaces"] == 1
    assert "dram" in stats and "ssd" in stats
    store.close_session(session)


def test_a_dram_get_is_counted_when_its_answer_is_released(open_store: Store) -> None:
    """A GET every key of which DRAM holds answers first and counts after (the transport
    releases the answer once the bytes are sent): hits, the pool's DRAM hits and the get
    latency appear at the release, once; a dropped, unreleased answer gives its pins back
    and counts when collected by reference count (no cycle keeps it alive)."""
    s, store = open_store, open_store.store
    session = store.open_session()
    ns = byte_namespace()
    s.declare(session, ns)
    keys = keys_of(3)
    s.put(session, ns, keys)

    def counts() -> tuple[int, int, int]:
        stats = store.stats(session, {})
        return (stats["server"].get("get_hits", 0), stats["pool"]["dram_hits"],
                stats["dram"]["hits"])

    before = counts()
    answer = store.get(session, ns.id, keys)
    assert answer.flags == b"\x01" * 3 and [bytes(v) for v in answer.views] == \
        [payload_for(k).tobytes() for k in keys]
    assert counts() == before  # nothing counted on the answer's path
    answer.release()
    assert counts() == (before[0] + 3, before[1] + 3, before[2] + 3)
    answer.release()  # idempotent: counted once
    assert counts() == (before[0] + 3, before[1] + 3, before[2] + 3)
    dropped = store.get(session, ns.id, keys[:1])
    del dropped  # never released: the pins go back (and count) when it is collected
    assert counts() == (before[0] + 4, before[1] + 4, before[2] + 4)
    assert store.delete(session, ns.id, keys) == 3
    assert store.stats(session, {})["dram"]["used_bytes"] == 0  # no pin held a slot back
    store.close_session(session)


def test_chunks_beyond_dram_are_served_from_the_ssd(open_store: Store) -> None:
    s, store = open_store, open_store.store
    session = store.open_session()
    ns = byte_namespace()
    s.declare(session, ns)
    keys = keys_of(40)  # 2.5 MiB through a 1 MiB arena: the first ones are demoted to SSD
    for i in range(0, 40, 8):
        assert s.put(session, ns, keys[i:i + 8]) == (8, 0)
    assert s.pool.flush(10.0)
    # In small batches: an SSD hit is promoted into DRAM, which a batch pinning the whole
    # arena would make wait (pool.get_many_into, dram.put_wait_s).
    for i in range(0, 40, 4):
        want = [payload_for(k).tobytes() for k in keys[i:i + 4]]
        assert s.get(session, ns, keys[i:i + 4]) == want
    assert s.pool.stats()["ssd"]["hits"] >= 24
    assert store.exists_prefix(session, ns.id, keys) == 40


def test_keys_are_scoped_by_namespace(open_store: Store) -> None:
    s, store = open_store, open_store.store
    session = store.open_session()
    a, b = byte_namespace(model="a"), byte_namespace(model="b")
    s.declare(session, a)
    s.declare(session, b)
    keys = keys_of(2)
    s.put(session, a, keys)
    assert s.get(session, b, keys) == [None, None]
    assert store.exists(session, b.id, keys) == [False, False]
    # What the pool holds is filed under the scoped key, not the client's.
    assert s.pool.contains_many(a, [scoped_chunk_key(a.id, k) for k in keys]) == [True, True]
    assert s.pool.contains_many(a, keys) == [False, False]


def test_an_aborted_put_publishes_nothing(open_store: Store) -> None:
    s, store = open_store, open_store.store
    session = store.open_session()
    ns = byte_namespace()
    s.declare(session, ns)
    keys = keys_of(3)

    batch = store.begin_put(session, ns.id, keys, 3 * CHUNK)
    target = batch.targets[0]
    assert target is not None
    target[:] = payload_for(keys[0]).tobytes()
    batch.abort()  # the peer went away before the rest arrived
    assert store.exists(session, ns.id, keys) == [False] * 3
    assert s.put(session, ns, keys) == (3, 0)  # the slots were given back


def test_error_statuses(tmp_path: Path) -> None:
    s = Store(tmp_path, max_item_bytes=CHUNK, max_inflight_bytes=4 * CHUNK,
              max_namespaces_per_connection=2, max_namespaces=3)
    store = s.store
    try:
        session = store.open_session()
        assert refused(store.declare, session, b"{not json").status == Status.BAD_REQUEST
        too_big = byte_namespace(chunk_bytes=2 * CHUNK)
        assert refused(s.declare, session, too_big).status == Status.TOO_LARGE
        ns = byte_namespace()
        keys = keys_of(5)
        unknown = refused(store.begin_put, session, ns.id, keys, 5 * CHUNK)
        assert unknown.status == Status.UNKNOWN_NAMESPACE and not unknown.close
        for call in (store.exists, store.exists_prefix, store.delete, store.get):
            assert refused(call, session, ns.id, keys).status == Status.UNKNOWN_NAMESPACE
        assert refused(store.touch, session, ns.id, keys).status == Status.UNKNOWN_NAMESPACE
        s.declare(session, ns)
        with pytest.raises(ProtocolError):
            store.begin_put(session, ns.id, keys, 5 * CHUNK - 1)
        assert refused(store.get, session, ns.id, keys).status == Status.TOO_LARGE
        s.declare(session, byte_namespace(model="second"))
        third = byte_namespace(model="third")
        assert refused(s.declare, session, third).status == Status.BAD_REQUEST  # per conn
        other = store.open_session()
        s.declare(other, third)  # the registry's third and last namespace
        full = refused(s.declare, other, byte_namespace(model="fourth"))
        assert full.status == Status.BUSY
        store.close_session(session)  # its two namespaces become unused: forgettable
        s.declare(other, byte_namespace(model="fourth"))
        stats = store.stats(other, {})["server"]
        assert stats["namespaces_refused"] == 1 and stats["namespaces_forgotten"] == 1
    finally:
        s.close()


def test_auth_and_tenancy(auth_store: Store) -> None:
    s, store = auth_store, auth_store.store
    session = store.open_session()
    assert not session.authenticated
    bad = refused(store.authenticate, session, b"wrong-token")
    assert bad.status == Status.AUTH_FAILED and bad.close
    hello = json.loads(store.authenticate(session, b"token-acme-123"))
    assert hello == {"node_id": "node-under-test", "tenants": ["acme"], "admin": False}
    acme, beta = byte_namespace(salt="acme"), byte_namespace(salt="beta:x")
    assert refused(s.declare, session, beta).status == Status.FORBIDDEN
    s.declare(session, acme)
    keys = keys_of(2)
    s.put(session, acme, keys)
    assert s.get(session, acme, keys) == [payload_for(k).tobytes() for k in keys]
    # A re-AUTH starts a new identity: what the previous token declared is gone.
    store.authenticate(session, b"token-beta-456")
    assert refused(store.get, session, acme.id, keys).status == Status.UNKNOWN_NAMESPACE
    s.declare(session, beta)
    assert s.get(session, beta, keys) == [None, None]
    # A tenant sees its own figures only; the admin sees the node and every tenant.
    mine = store.stats(session, {"connections": 9})
    assert set(mine) == {"server", "tenants", "namespaces", "retention"} \
        and set(mine["tenants"]) == {"beta"}
    assert "connections" not in mine["server"]
    assert [n["id"] for n in mine["namespaces"]] == [beta.id.hex()]  # acme's stays unlisted
    admin = store.open_session()
    assert json.loads(store.authenticate(admin, ADMIN.encode()))["admin"] is True
    assert refused(s.declare, admin, acme).status == Status.FORBIDDEN
    everything = store.stats(admin, {"connections": 9})
    assert everything["server"]["connections"] == 9 and "ssd" in everything
    tenants = everything["tenants"]
    assert tenants["acme"]["put_chunks"] == 2 and tenants["acme"]["get_hits"] == 2
    assert tenants["beta"]["get_misses"] == 2 and tenants["beta"]["connections"] == 1
    assert everything["server"]["auth_failures"] == 1
    assert {n["id"] for n in everything["namespaces"]} == {acme.id.hex(), beta.id.hex()}



def test_invalidate_by_id_without_declaring(auth_store: Store) -> None:
    """What `kvpool admin invalidate` sends: an id, on a connection that declared nothing.
    A tenant token may drop its tenants' namespaces the node knows, the admin token any."""
    s, store = auth_store, auth_store.store
    writer = store.open_session()
    store.authenticate(writer, b"token-acme-123")
    acme, other = byte_namespace(salt="acme"), byte_namespace(salt="acme:other")
    for ns in (acme, other):
        s.declare(writer, ns)
        s.put(writer, ns, keys_of(3))
    beta = store.open_session()
    store.authenticate(beta, b"token-beta-456")
    assert refused(store.invalidate, beta, acme.id).status == Status.FORBIDDEN
    tenant = store.open_session()
    store.authenticate(tenant, b"token-acme-123")
    assert store.invalidate(tenant, acme.id) == 3  # DRAM copies (evict mode)
    assert store.exists(writer, acme.id, keys_of(3)) == [False] * 3
    assert store.exists(writer, other.id, keys_of(3)) == [True] * 3  # untouched
    unknown = bytes(range(16))  # no client declared it here: its tenant is unknown
    assert refused(store.invalidate, tenant, unknown).status == Status.FORBIDDEN
    admin = store.open_session()
    store.authenticate(admin, ADMIN.encode())
    assert store.invalidate(admin, unknown) == 0
    assert store.invalidate(admin, other.id) == 3
    assert store.exists(writer, other.id, keys_of(3)) == [False] * 3


def test_stats_list_namespaces_and_the_drain_flag(open_store: Store) -> None:
    s, store = open_store, open_store.store
    session = store.open_session()
    ns = byte_namespace(model="listed", salt="t1:x")
    s.declare(session, ns)
    stats = store.stats(session, {})
    assert stats["namespaces"] == [{"id": ns.id.hex(), "model": "listed", "revision": "main",
                                    "tenant": "t1", "chunk_bytes": CHUNK, "in_use": True}]
    assert stats["server"]["draining"] is False
    store.drain_flag = lambda: True
    assert store.drained
    store.close_session(session)
    stats = store.stats(store.open_session(), {})
    assert stats["server"]["draining"] is True and not stats["namespaces"][0]["in_use"]


def test_a_put_keeps_what_fits_the_held_bytes_budget_and_busy_when_nothing_fits(
        tmp_path: Path) -> None:
    s = Store(tmp_path, max_held_bytes=4 * CHUNK)
    try:
        store = s.store
        session = store.open_session()
        ns = byte_namespace()
        s.declare(session, ns)
        stored_first = keys_of(2, b"s")
        assert s.put(session, ns, stored_first) == (2, 0)
        # 2 stored + 6 new: the stored ones take no room, 4 of the new fit, 2 are dropped
        keys = [*stored_first, *keys_of(6, b"n")]
        assert s.put(session, ns, keys) == (6, 4)
        assert store.counters.snapshot()["held_dropped_chunks"] == 2
        assert store.held.held == 0  # given back on commit
        found = s.get(session, ns, keys)
        assert sum(f is not None for f in found) == 6

        batch = store.begin_put(session, ns.id, keys_of(4, b"h"), 4 * CHUNK)
        try:
            assert store.held.held == 4 * CHUNK
            busy = refused(store.begin_put, session, ns.id, keys_of(1, b"x"), CHUNK)
        finally:
            batch.abort()
        assert busy.status is Status.BUSY and "max_held_bytes" in busy.message
        assert store.held.held == 0
    finally:
        s.close()
