"""Shared fixtures (helpers live in kvtest.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtest import byte_namespace
from node_process import NodeProcess

from kvpool.keys import Namespace


@pytest.fixture
def ns() -> Namespace:
    return byte_namespace()


@pytest.fixture
def keys() -> list[bytes]:
    return [os.urandom(16) for _ in range(64)]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[NodeProcess]:
    """A real ``kvpool serve`` node of the test's own (no auth), which it may kill and
    restart; stopped by PID afterwards."""
    proc = NodeProcess(tmp_path / "node")
    proc.start()
    yield proc
    proc.stop()
