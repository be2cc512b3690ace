"""Fixtures for cluster tests: a real etcd on 127.0.0.1 (scripts/system-deps.sh installs it).

- ``etcd_endpoint`` (session): the endpoint of one etcd shared by the whole session; tests
  keep apart by using their own cluster name (``cluster_name``).
- ``etcd_server`` (function): a fresh etcd of the test's own, which it may kill and restart.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from etcd_fixture import EtcdServer, etcd_binary


def _require_etcd() -> None:
    if etcd_binary() is None:
        pytest.fail("etcd is not installed: run scripts/system-deps.sh", pytrace=False)


@pytest.fixture(scope="session")
def etcd_session_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    _require_etcd()
    server = EtcdServer(tmp_path_factory.mktemp("etcd-session"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def etcd_endpoint(etcd_session_server: EtcdServer) -> str:
    """``http://127.0.0.1:<port>`` of the session's etcd. Do not kill it; use etcd_server."""
    return etcd_session_server.endpoint


@pytest.fixture
def etcd_server(tmp_path: Path) -> Iterator[EtcdServer]:
    """A started etcd for this test alone; stopped (by PID) afterwards."""
    _require_etcd()
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def cluster_name(request: pytest.FixtureRequest) -> str:
    """A cluster name no other test uses."""
    stem = re.sub(r"[^A-Za-z0-9_-]+", "-", request.node.name)[:40]
    return f"{stem}-{uuid.uuid4().hex[:8]}"
