"""Tenancy on a real node: STATS answers a tenant with its own figures only (node-wide ones
to the admin token), and a re-AUTH drops what the previous token declared."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from kvtest import byte_namespace, payload_for
from node_process import NodeProcess

from kvpool.net.connection import NodeConnection
from kvpool.net.protocol import AuthError, Op, RemoteError

CHUNK = 64 * 1024
ACME, BETA, BOTH, ADMIN = "token-acme-123", "token-beta-456", "token-both-789", "admin-token-0"
TOKENS = [{"token": ACME, "tenants": ["acme"]}, {"token": BETA, "tenants": ["beta"]},
          {"token": BOTH, "tenants": ["acme", "beta"]}]
NODE_WIDE = {"dram", "ssd", "pool", "write_behind"}


@pytest.fixture
def admin_node(tmp_path: Path) -> Iterator[NodeProcess]:
    with NodeProcess(tmp_path / "n", server={"auth": TOKENS, "admin_token": ADMIN}) as node:
        yield node


@pytest.fixture
def tenant_node(tmp_path: Path) -> Iterator[NodeProcess]:
    with NodeProcess(tmp_path / "n", server={"auth": TOKENS}) as node:
        yield node


def put_and_get(conn: NodeConnection, salt: str, n: int) -> None:
    ns = byte_namespace(CHUNK, salt=salt)
    keys = [os.urandom(16) for _ in range(n)]
    assert conn.put(ns, keys, [payload_for(k, CHUNK) for k in keys]) == n
    outs = [np.zeros(CHUNK, np.uint8) for _ in range(n + 1)]
    assert conn.get_into(ns, [*keys, os.urandom(16)], outs) == [True] * n + [False]


def test_stats_answer_a_tenant_with_its_own_figures_and_the_admin_with_the_node(
        admin_node: NodeProcess) -> None:
    acme = NodeConnection(admin_node.address, token=ACME)
    beta = NodeConnection(admin_node.address, token=BETA)
    put_and_get(acme, "acme:a", 3)
    put_and_get(beta, "beta:b", 5)

    mine = acme.stats()
    assert set(mine) == {"server", "tenants", "namespaces", "retention"}
    assert [n["tenant"] for n in mine["namespaces"]] == ["acme"]
    assert set(mine["server"]) == {"node_id", "version", "uptime_s", "gc_frozen_objects"}
    assert set(mine["tenants"]) == {"acme"}
    figures = mine["tenants"]["acme"]
    assert (figures["put_chunks"], figures["put_bytes"]) == (3, 3 * CHUNK)
    assert (figures["get_hits"], figures["get_misses"], figures["get_bytes"]) == \
        (3, 1, 3 * CHUNK)
    assert (figures["namespaces_declared"], figures["connections"]) == (1, 1)
    assert figures["requests"] == 2  # one PUT, one GET
    assert beta.stats()["tenants"]["beta"]["put_chunks"] == 5

    both = NodeConnection(admin_node.address, token=BOTH)
    assert set(both.stats()["tenants"]) == {"acme", "beta"}
    assert both.stats()["tenants"]["acme"]["connections"] == 2

    admin = NodeConnection(admin_node.address, token=ADMIN)
    full = admin.stats()
    assert set(full) >= NODE_WIDE
    assert full["server"]["connections"] == 4 and full["server"]["put_chunks"] == 8
    assert full["tenants"]["beta"]["put_chunks"] == 5
    with pytest.raises(AuthError, match="FORBIDDEN"):  # the admin token reads no tenant data
        admin.declare(byte_namespace(CHUNK, salt="acme:a"))
    for conn in (acme, beta, both, admin):
        conn.close()


def test_reauth_drops_the_namespaces_declared_under_the_previous_token(
        tenant_node: NodeProcess) -> None:
    conn = NodeConnection(tenant_node.address, token=ACME)
    ns = byte_namespace(CHUNK, salt="acme:private")
    keys = [os.urandom(16) for _ in range(2)]
    assert conn.put(ns, keys, [payload_for(k, CHUNK) for k in keys]) == 2
    conn.call(Op.AUTH, meta=BETA.encode())  # same connection, now tenant beta
    outs = [np.zeros(CHUNK, np.uint8) for _ in keys]
    with pytest.raises(RemoteError, match="UNKNOWN_NAMESPACE"):
        conn.get_into(ns, keys, outs)  # declared under acme: gone
    assert all(not o.any() for o in outs)
    conn.declared.clear()
    with pytest.raises(AuthError, match="FORBIDDEN"):
        conn.declare(ns)
    assert "acme" not in conn.stats()["tenants"]
    conn.call(Op.AUTH, meta=ACME.encode())  # back to acme: declare again, the data is there
    assert conn.get_into(ns, keys, outs) == [True, True]
    conn.close()


def test_without_auth_stats_stay_node_wide(node: NodeProcess) -> None:
    conn = NodeConnection(node.address)
    assert set(conn.stats()) >= NODE_WIDE
    conn.close()
