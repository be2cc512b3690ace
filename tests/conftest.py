"""Shared fixtures (helpers live in kvtest.py), and the marks that split the suite.

A test that needs something outside ``.venv`` carries one mark per need (``etcd``, ``redis``,
``vllm``, ``sglang``, ``model``, ``prometheus``, ``netns``, ``pypi``, ``kubectl``, ``image``)
and, added here, ``external``; ``make unit`` runs ``-m "not external"``.
The needs are marked here from the fixtures a test uses (its whole fixture closure), so a new
test on those fixtures is classified without a mark of its own; a test that reaches a service
without a fixture carries the mark itself (``@pytest.mark.redis``). Such a test fails, never
skips, when the service is missing, so ``make unit`` cannot pass by skipping one. The one
exception is ``image`` (tests/test_containerfile.py): it skips, saying why, on a machine that
cannot build a container image (no root, podman or Debian mirror).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtest import build_dist, byte_namespace
from node_process import NodeProcess

from kvpool.keys import Namespace

# Fixture -> the mark of what it needs (tests/cluster/conftest.py, tests/vllm/conftest.py,
# tests/sglang/conftest.py, tests/test_models.py).
NEEDS_BY_FIXTURE = {
    "etcd_session_server": "etcd",  # behind etcd_endpoint
    "etcd_server": "etcd",
    "vllm_python": "vllm",  # behind start_engine, run_engine, baseline
    "sglang_python": "sglang",  # behind run_check (tests/sglang/conftest.py)
    "smollm2_cache": "model",  # converts the real SmolLM2 GGUF
    "netlab": "netns",  # root and iproute2 (tests/cluster/test_partition.py)
    "installed_wheel": "pypi",  # pip installs the wheel's dependencies (test_packaging.py)
}
EXTERNAL_NEEDS = ("etcd", "redis", "vllm", "sglang", "model", "prometheus", "netns", "pypi",
                  "kubectl", "image")


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by these marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for fixture in getattr(item, "fixturenames", ()):
            need = NEEDS_BY_FIXTURE.get(fixture)
            if need is not None:
                item.add_marker(need)
        if any(item.get_closest_marker(need) for need in EXTERNAL_NEEDS):
            item.add_marker("external")


@pytest.fixture(scope="session")
def built_dist(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """kvpool's (wheel, sdist), built once per session from this checkout's sources
    (kvtest.build_dist): the packaging test installs this wheel and the image build puts it
    into the container image."""
    return build_dist(Path(__file__).resolve().parent.parent, tmp_path_factory.mktemp("dist"))


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
