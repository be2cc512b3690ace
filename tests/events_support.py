"""Helpers for the KV event and query API tests: a node's /events and /query over HTTP, a
client pool that writes only to the nodes, a consumer following a node, and one polled by
a thread of its own (``Follower``)."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from node_process import NodeProcess

from kvpool.config import config_from_dict
from kvpool.events.consumer import EventConsumer
from kvpool.events.schema import BlockStored, KVEventBatch
from kvpool.keys import Namespace
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


class Follower:
    """An EventConsumer polled all the time by a thread of its own, as ``kvpool route``
    polls: a SUB socket takes in its publisher's restart (and subscribes again) only when it
    is polled. Keeps every BlockStored applied and every reset (its EventListener)."""

    def __init__(self, info: dict[str, str]) -> None:
        self.stored: list[BlockStored] = []
        self.resets: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._consumer = EventConsumer([(info["endpoint"], info["replay_endpoint"])],
                                       listener=self)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                self._consumer.poll(0.02)
            time.sleep(0.005)

    def batch(self, node: str, source: str, seq: int, batch: KVEventBatch) -> None:
        self.stored.extend(e for e in batch.events if isinstance(e, BlockStored))

    def reset(self, node: str, source: str, reason: str) -> None:
        self.resets.append((node, reason))

    def held(self, node: str, medium: str, ns: Namespace) -> set[bytes]:
        with self._lock:
            return self._consumer.held(node, medium, ns.id)

    def prefix(self, node: str, medium: str, ns: Namespace, keys: list[bytes]) -> int:
        with self._lock:
            return self._consumer.prefix(node, medium, ns.id, keys)

    def leading_run(self, ns: Namespace, keys: list[bytes]) -> int:
        """The leading run of ``keys`` any publisher followed holds, on any medium."""
        with self._lock:
            return self._consumer.leading_run(list(self._consumer.nodes), ns.id, keys)

    def tenant(self, node: str, ns: Namespace) -> str | None:
        with self._lock:
            return self._consumer.tenant(node, ns.id)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._consumer.close()
