"""Registering the mapped arena as pinned host memory when torch sees a CUDA device. The
build machine has no GPU: torch's cudart is replaced by a recorder (the only mock: the
device), and the test checks what the attach asks of it."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
from host_support import engine_config, host_config

from kvpool.config import config_from_dict
from kvpool.host.client import AttachedPool
from kvpool.host.server import HostServer


class _Cudart:
    def __init__(self, result: int = 0) -> None:
        self.result = result
        self.calls: list[tuple[Any, ...]] = []

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        self.calls.append(("register", address, nbytes, flags))
        return self.result

    def cudaHostUnregister(self, address: int) -> int:
        self.calls.append(("unregister", address))
        return 0


def _fake_torch(cudart: _Cudart, available: bool) -> types.ModuleType:
    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        is_available=lambda: available, cudart=lambda: cudart)
    return torch


@pytest.mark.parametrize("available", [True, False])
def test_attach_registers_the_arena_when_a_device_is_seen(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, available: bool) -> None:
    cudart = _Cudart()
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(cudart, available))
    data = host_config(tmp_path)
    server = HostServer(config_from_dict(data)).start()
    try:
        pool = AttachedPool(engine_config(data))
        link = pool._link_now
        assert link is not None
        if not available:
            assert cudart.calls == [] and not link.cuda
        else:
            assert link.cuda
            assert cudart.calls == [("register", link.address, 8 << 20, 1)]
        pool.close()
        if available:
            assert cudart.calls[-1] == ("unregister", link.address)
        off = AttachedPool(engine_config(data, cuda_register="off"))
        assert off._link_now is not None and not off._link_now.cuda
        off.close()
    finally:
        server.stop()


def test_a_refused_registration_leaves_the_arena_pageable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cudart = _Cudart(result=712)  # cudaErrorHostMemoryAlreadyRegistered
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(cudart, True))
    data = host_config(tmp_path)
    server = HostServer(config_from_dict(data)).start()
    try:
        with AttachedPool(engine_config(data)) as pool:
            assert pool._link_now is not None and not pool._link_now.cuda
            assert pool.attached
        assert [c[0] for c in cudart.calls] == ["register"]  # nothing to unregister
    finally:
        server.stop()
