"""`kvpool admin` against a real node with auth on, listed statically (no etcd): what a tenant
token and the admin token may see and drop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtest import byte_namespace, child_env, payload_for
from node_process import NodeProcess

from kvpool.net.connection import NodeConnection

CHUNK = 16 * 1024
ACME, BETA, ADMIN = "token-acme-123", "token-beta-456", "admin-token-0"
TOKENS = [{"token": ACME, "tenants": ["acme"]}, {"token": BETA, "tenants": ["beta"]}]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[NodeProcess]:
    with NodeProcess(tmp_path / "n", server={"auth": TOKENS, "admin_token": ADMIN}) as proc:
        yield proc


def admin(tmp_path: Path, node: NodeProcess, token: str,
          *args: str) -> subprocess.CompletedProcess[str]:
    config = tmp_path / f"{token}.yaml"
    config.write_text(f"cluster: {{nodes: ['{node.address}'], token: '{token}'}}\n")
    out = subprocess.run([sys.executable, "-m", "kvpool.cli", "admin", *args, "--config",
                          str(config)], capture_output=True, text=True, timeout=60,
                         env=child_env())
    assert "Traceback" not in out.stderr, out.stderr
    return out


def test_tenant_and_admin_tokens(node: NodeProcess, tmp_path: Path) -> None:
    acme, beta = byte_namespace(CHUNK, "m", salt="acme"), byte_namespace(CHUNK, "m", salt="beta")
    keys = [os.urandom(16) for _ in range(4)]
    for token, ns in ((ACME, acme), (BETA, beta)):
        conn = NodeConnection(node.address, token=token)
        assert conn.put(ns, keys, [payload_for(k, CHUNK) for k in keys]) == 4
        conn.close()
    stats = json.loads(admin(tmp_path, node, BETA, "stats", "--json").stdout)
    assert [n["tenant"] for n in stats[node.address]["namespaces"]] == ["beta"]
    # beta may not drop acme's namespace, by id or by model (it does not even see it)
    refused = admin(tmp_path, node, BETA, "invalidate", acme.id.hex())
    assert refused.returncode == 1 and "FORBIDDEN" in refused.stdout
    mine = admin(tmp_path, node, BETA, "invalidate", "--model", "m", "--json")
    assert mine.returncode == 0, mine.stderr
    assert [r["namespace"] for r in json.loads(mine.stdout)["invalidated"]] == [beta.id.hex()]
    conn = NodeConnection(node.address, token=ACME)
    assert conn.exists(acme, keys) == [True] * 4
    conn.close()
    everything = admin(tmp_path, node, ADMIN, "invalidate", "--model", "m", "--json")
    assert everything.returncode == 0
    assert {r["namespace"] for r in json.loads(everything.stdout)["invalidated"]} == \
        {acme.id.hex(), beta.id.hex()}
    conn = NodeConnection(node.address, token=ACME)
    assert conn.exists(acme, keys) == [False] * 4
    conn.close()
    wrong = admin(tmp_path, node, "not-a-token", "stats")
    assert wrong.returncode == 1 and "refused" in wrong.stdout + wrong.stderr
