"""Fixtures: real ``kvpool serve`` processes on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from node_process import NodeProcess

TOKENS = [{"token": "token-acme-123", "tenants": ["acme"]},
          {"token": "token-beta-456", "tenants": ["beta"]},
          {"token": "token-both-789", "tenants": ["acme", "beta"]}]


@pytest.fixture(scope="module")
def auth_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """One node requiring tokens (see TOKENS), shared by a module's tests."""
    with NodeProcess(tmp_path_factory.mktemp("node"), server={"auth": TOKENS}) as node:
        yield node
