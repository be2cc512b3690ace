"""Helpers for the KV event and query API tests: a node's /events and /query over HTTP, a
client pool that writes only to the nodes, and a consumer following a node."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from node_process import NodeProcess

from kvpool.config import config_from_dict
from kvpool.events.consumer import EventConsumer
from kvpool.pool import KVPool


def get_json(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
        return json.loads(answer.read())


def post_json(port: int, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """(HTTP status, decoded JSON body)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                     json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def node_only_pool(tmp_path: Path, *nodes: NodeProcess) -> KVPool:
    """A client pool with no local tier: every put goes to the nodes."""
    return KVPool(config_from_dict({
        "cache_dir": str(tmp_path / "client"), "dram": {"capacity": 0},
        "ssd": {"enabled": False},
        "cluster": {"nodes": [n.address for n in nodes], "retry_down_s": 0.2}}))


def follow(node: NodeProcess, **kwargs: Any) -> EventConsumer:
    assert node.metrics_port is not None
    info = get_json(node.metrics_port, "/events")
    return EventConsumer([(info["endpoint"], info["replay_endpoint"])], **kwargs)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
