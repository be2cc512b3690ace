"""A real node's logs: JSON lines with event fields (an auth failure names the peer), level
filtering, and no memory warning at a small dram.capacity."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kvtest import byte_namespace
from node_process import NodeProcess

from kvpool.config import ClusterConfig
from kvpool.net.client import ClusterClient
from kvpool.net.connection import NodeConnection
from kvpool.net.protocol import AuthError, Op

TOKENS = [{"token": "token-acme-123", "tenants": ["acme"]}]


def json_lines(node: NodeProcess) -> list[dict[str, Any]]:
    """Every line the node wrote to stderr, parsed (each must be one JSON object)."""
    return [json.loads(line) for line in node.log.read_text().splitlines()]


def test_auth_failure_is_a_json_line_with_the_peer_and_no_memory_warning(
        tmp_path: Path) -> None:
    with NodeProcess(tmp_path, server={"auth": TOKENS, "node_id": "logged-node"},
                     log={"format": "json"}) as node:
        conn = NodeConnection(node.address)
        peer = conn.sock.getsockname()
        with pytest.raises(AuthError, match="AUTH_FAILED"):
            conn.call(Op.AUTH, meta=b"not-a-token-at-all")
        conn.close()
        client = ClusterClient(ClusterConfig(nodes=[node.address], token="token-acme-123"))
        client.register_namespace(byte_namespace(salt="acme"))  # a good token: no event
        client.close()
        lines = json_lines(node)
    [failure] = [d for d in lines if d["event"] == "auth_failure"]
    assert failure["level"] == "warning" and failure["logger"] == "kvpool.serve"
    assert failure["node"] == "logged-node"
    assert failure["peer"] == f"{peer[0]}:{peer[1]}" and failure["held_back"] == 0
    assert "not-a-token" not in json.dumps(failure)
    assert not [d for d in lines if d["event"] == "memory_reserve"]  # 64 MiB of DRAM
    assert any(d["level"] == "info" for d in lines)  # the start-up lines are there


def test_log_level_warning_keeps_info_lines_out(tmp_path: Path) -> None:
    with NodeProcess(tmp_path, log={"level": "warning"}):
        pass
    text = tmp_path.joinpath("node.log").read_text()
    assert " INFO " not in text
