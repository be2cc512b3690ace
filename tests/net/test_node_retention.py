"""Retention on real ``kvpool serve`` nodes (docs/retention.md): a pinned prefix survives a
flood of ephemeral and normal saves that overflows the node's DRAM, ephemeral saves never
reach a node, a tenant at its quota never evicts another tenant's chunks, TTLs expire,
RELEASE ends a session of one tenant only, and pins past a node's bound are refused with
PIN_LIMIT. The nodes have no SSD, so a chunk their DRAM evicted is gone (a GET miss)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml
from kvtest import byte_namespace, child_env, payload_for, small_config
from node_process import NodeProcess
from tests_support import wait_until

from kvpool.errors import PinLimitError
from kvpool.keys import Namespace
from kvpool.net.connection import NodeConnection
from kvpool.net.protocol import Op, RemoteError, RemotePinLimitError, Status, pack_retain
from kvpool.pool import KVPool
from kvpool.retention import Priority, Retention

CHUNK = 64 * 1024
ACME, BETA, ADMIN = "token-acme-123", "token-beta-456", "admin-token-0"
TOKENS = [{"token": ACME, "tenants": ["acme"]}, {"token": BETA, "tenants": ["beta"]}]
#: 16 chunks of DRAM, no SSD: what the node evicts is gone.
SMALL = {"dram": {"capacity": "1MiB", "slab_size": "256KiB"}, "ssd": {"enabled": False}}


def small_node(base: Path, **sections: dict[str, object]) -> NodeProcess:
    merged: dict[str, dict[str, object]] = {name: dict(values) for name, values in SMALL.items()}
    for name, values in sections.items():
        merged.setdefault(name, {}).update(values)
    return NodeProcess(base, **merged)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """Shared by the tests without auth; each leaves no pin behind."""
    with small_node(tmp_path_factory.mktemp("node"),
                    pool={"max_pinned_fraction": 0.25}) as proc:
        yield proc


@pytest.fixture
def quota_node(tmp_path: Path) -> Iterator[NodeProcess]:
    with small_node(tmp_path / "q", server={"auth": TOKENS, "admin_token": ADMIN},
                    pool={"tenant_quotas": {"acme": {"dram_bytes": 4 * CHUNK}}}) as proc:
        yield proc


def keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def on_node(conn: NodeConnection, ns: Namespace, ks: list[bytes]) -> list[bool]:
    outs = [np.zeros(CHUNK, np.uint8) for _ in ks]
    found = conn.get_into(ns, ks, outs)
    for k, out, hit in zip(ks, outs, found, strict=True):
        if hit:
            assert np.array_equal(out, payload_for(k, CHUNK))
    return found


def client_pool(tmp_path: Path, node: NodeProcess, name: str = "c") -> KVPool:
    """An engine's pool: DRAM only locally, the node below it."""
    return KVPool(small_config(tmp_path / name, ssd={"enabled": False},
                               pool={"max_pinned_fraction": 1.0},
                               cluster={"nodes": [node.address], "retry_down_s": 0.2}))


def put(pool: KVPool, ns: Namespace, ks: list[bytes], r: Retention | None = None) -> int:
    return pool.put_many(ns, ks, [payload_for(k, CHUNK) for k in ks], r)


def test_pinned_prefix_survives_a_flood_and_ephemeral_saves_never_reach_the_node(
        node: NodeProcess, tmp_path: Path) -> None:
    ns = byte_namespace(CHUNK, salt="app")
    conn = NodeConnection(node.address)
    put_before = conn.stats()["server"].get("put_chunks", 0)
    with client_pool(tmp_path, node) as pool:
        pool.register_namespace(ns)
        prefix = keys(4)
        assert put(pool, ns, prefix, Retention(Priority.PIN, session="system")) == 4
        normal, fleeting = [], []
        for _ in range(5):  # 40 normal chunks through the node's 16 slots
            batch, thrown = keys(8), keys(8)
            put(pool, ns, thrown, Retention(Priority.EPHEMERAL))
            put(pool, ns, batch)
            assert pool.flush(10)  # one PUT of 8 at a time: the node has 12 unpinned slots
            normal += batch
            fleeting += thrown
        assert on_node(conn, ns, prefix) == [True] * 4
        assert sum(on_node(conn, ns, normal)) <= 12  # the rest was evicted
        assert not any(on_node(conn, ns, fleeting))
        stats = conn.stats()
        # the pinned prefix and the normal saves
        assert stats["server"]["put_chunks"] - put_before == 44
        assert stats["retention"]["pinned_bytes"] == 4 * CHUNK
        # the session ends: the node unpins its chunks, and deletes them when asked
        assert pool.release("system", delete=True) == 4
        assert not any(on_node(conn, ns, prefix))
        assert conn.stats()["retention"]["pinned_bytes"] == 0
    conn.close()


def test_pins_past_the_node_bound_are_refused_with_pin_limit(node: NodeProcess,
                                                             tmp_path: Path) -> None:
    ns = byte_namespace(CHUNK, salt="app")
    conn = NodeConnection(node.address)
    pin = Retention(Priority.PIN, session="bound").to_mapping()
    assert conn.retain(ns, keys(3), pin) == 3  # the bound: 4 of 16 chunks
    with pytest.raises(RemotePinLimitError, match="max_pinned_fraction") as refused:
        conn.retain(ns, keys(2), pin)
    assert refused.value.status is Status.PIN_LIMIT
    assert isinstance(refused.value, PinLimitError)
    with client_pool(tmp_path, node) as pool:  # the client's own bound is DRAM-wide
        pool.register_namespace(ns)
        wanted = keys(2)
        with pytest.raises(PinLimitError):
            put(pool, ns, wanted, Retention(Priority.PIN))
        assert pool.stats()["retention"]["pinned_bytes"] == 0  # undone locally too
        assert not any(pool.contains_many(ns, wanted))  # and nothing saved
    with pytest.raises(RemoteError, match="BAD_REQUEST: bad retention: retention priority"):
        conn.call(Op.RETAIN, 1, pack_retain(ns.id, keys(1), {"priority": "urgent"}))
    stats = conn.stats()
    assert stats["server"]["pins_refused"] == 2
    assert stats["retention"]["pinned_bytes"] == 3 * CHUNK
    assert conn.release(ns, "bound", delete=False) == 3
    assert conn.stats()["retention"]["pinned_bytes"] == 0
    conn.close()


def test_ttl_expires_on_the_node(node: NodeProcess) -> None:
    ns = byte_namespace(CHUNK, salt="app")
    conn = NodeConnection(node.address)
    short, kept = keys(3), keys(3)
    conn.retain(ns, short, Retention(expires_at=time.time() + 0.5).to_mapping())
    conn.put(ns, short + kept, [payload_for(k, CHUNK) for k in short + kept])
    assert on_node(conn, ns, short + kept) == [True] * 6
    time.sleep(0.7)
    assert on_node(conn, ns, short + kept) == [False] * 3 + [True] * 3
    assert conn.exists(ns, short) == [False] * 3
    assert conn.stats()["retention"]["expired"] == 3
    # the node's once-a-second sweep removed them from every tier (KVPool.expire)
    assert wait_until(lambda: conn.stats()["retention"]["expired_pending"] == 0, 10)
    conn.close()


def test_tenant_at_its_quota_never_evicts_another_tenants_chunks(
        quota_node: NodeProcess, tmp_path: Path) -> None:
    acme_ns, beta_ns = byte_namespace(CHUNK, salt="acme:x"), byte_namespace(CHUNK, salt="beta")
    acme = NodeConnection(quota_node.address, token=ACME)
    beta = NodeConnection(quota_node.address, token=BETA)
    theirs = keys(8)
    assert beta.put(beta_ns, theirs, [payload_for(k, CHUNK) for k in theirs]) == 8
    mine = []
    for _ in range(6):  # 24 chunks of acme through its 4-chunk quota
        batch = keys(4)
        acme.put(acme_ns, batch, [payload_for(k, CHUNK) for k in batch])
        mine += batch
    assert on_node(beta, beta_ns, theirs) == [True] * 8
    assert sum(on_node(acme, acme_ns, mine)) == 4
    assert on_node(acme, acme_ns, mine[-4:]) == [True] * 4  # its newest, by its policy
    # every acme chunk pinned: its next save is dropped, beta's chunks stay
    assert acme.retain(acme_ns, mine[-4:], Retention(Priority.PIN).to_mapping()) == 4
    late = keys(2)
    assert acme.put(acme_ns, late, [payload_for(k, CHUNK) for k in late]) == 0
    assert on_node(beta, beta_ns, theirs) == [True] * 8
    admin = NodeConnection(quota_node.address, token=ADMIN)
    tenants = admin.stats()["retention"]["tenants"]
    assert tenants["acme"]["dram_bytes"] == 4 * CHUNK
    assert tenants["acme"]["dram_quota_bytes"] == 4 * CHUNK
    assert tenants["acme"]["quota_drops"] == 2
    assert tenants["beta"]["dram_bytes"] == 8 * CHUNK
    # a tenant sees its own bytes and quota only; kvpool admin stats shows every tenant's
    assert acme.stats()["retention"] == {"tenants": {"acme": tenants["acme"]}}
    config = tmp_path / "admin.yaml"
    config.write_text(yaml.safe_dump({"cluster": {"nodes": [quota_node.address],
                                                  "token": ADMIN}}))
    shown = subprocess.run([sys.executable, "-m", "kvpool.cli", "admin", "stats", "--config",
                            str(config), "--json"], capture_output=True, text=True,
                           env=child_env(), timeout=60, check=True)
    node_stats = json.loads(shown.stdout)[quota_node.address]
    assert node_stats["retention"]["tenants"]["acme"]["quota_drops"] == 2
    # sessions are per tenant: beta ending "s" leaves acme's "s" alone
    s = Retention(Priority.HIGH, session="s").to_mapping()
    acme.retain(acme_ns, mine[-2:], s)
    beta.retain(beta_ns, theirs[:2], s)
    assert beta.release(beta_ns, "s", delete=True) == 2
    assert on_node(beta, beta_ns, theirs[:2]) == [False, False]
    assert on_node(acme, acme_ns, mine[-2:]) == [True, True]
    for conn in (acme, beta, admin):
        conn.close()
