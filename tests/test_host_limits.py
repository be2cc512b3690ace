"""Greedy peers against the host pool (``kvpool host``): a flood of connections, large
messages declared and never finished, and the host pool out of file descriptors. Each one
costs the greedy peer, never the engines already attached."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from host_child import chunks, namespace
from host_support import engine_config, host_config, run_child, start_host, write_config
from kvtest import wait_for

from kvpool.config import config_from_dict
from kvpool.host import wire
from kvpool.host.client import AttachedPool
from kvpool.host.server import HostServer


def _round_trip(pool: AttachedPool, seed: int) -> bool:
    """Save two chunks, read them back: True when both come back with the same bytes."""
    ns = pool.register_namespace(namespace())
    keys, datas = chunks(ns, seed, 2)
    if pool.put_many(ns, keys, datas) != 2:
        return False
    outs = [np.zeros_like(d) for d in datas]
    hits = pool.get_many_into(ns, keys, outs)
    return all(hits) and all(np.array_equal(o, d) for o, d in zip(outs, datas, strict=True))


def _raw(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(20)
    sock.connect(path)
    return sock


def _attached_raw(path: str) -> socket.socket:
    """A connection that attached by hand (its arena descriptor closed at once)."""
    sock = _raw(path)
    wire.send_frame(sock, {"op": wire.HELLO, "version": wire.VERSION, "token": None,
                          "tenant": "default"})
    answer, _, fds = wire.recv_frame(sock, 0, want_fds=1)
    for fd in fds:
        os.close(fd)
    assert answer["ok"] is True, answer
    return sock


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        while sock.recv(65536):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    return True


@pytest.fixture
def host(tmp_path: Path) -> Iterator[tuple[HostServer, dict[str, object]]]:
    data = host_config(tmp_path, host={"max_connections": 4, "max_receive_bytes": "3MiB",
                                       "max_frame_bytes": "8MiB", "request_timeout_s": 30.0})
    server = HostServer(config_from_dict(data)).start()
    try:
        yield server, data
    finally:
        server.stop()


def test_connections_past_the_limit_are_busy_and_the_attached_engine_keeps_working(
        host: tuple[HostServer, dict[str, object]]) -> None:
    server, data = host
    path = str(data["host"]["socket"])  # type: ignore[index]
    engine = AttachedPool(engine_config(data))
    flood: list[socket.socket] = []
    late: AttachedPool | None = None
    try:
        assert _round_trip(engine, 1)
        flood = [_raw(path) for _ in range(3)]  # with the engine: the limit of 4
        wait_for(lambda: len(server._connections) == 4, 20, "four connections served")
        late = AttachedPool(engine_config(data, retry_s=0.1))
        extra = _raw(path)
        answer, _, _ = wire.recv_frame(extra, 0)
        assert answer["ok"] is False and answer["error"].startswith("busy:")
        assert _closed_by_peer(extra)
        extra.close()
        assert not _round_trip(late, 2)  # busy: detached, a dropped save, no error
        assert late.stats()["attached"]["detached_drops"] >= 2
        assert _round_trip(engine, 3)  # the attached engine is not disturbed
        assert server.refused_busy >= 2
        for sock in flood:
            sock.close()
        room = late
        wait_for(lambda: _round_trip(room, 4), 20, "the late engine attached once room was made")
    finally:
        for sock in flood:
            sock.close()
        engine.close()
        if late is not None:
            late.close()


def test_large_messages_past_the_receive_budget_close_their_connection_and_a_stall_times_out(
        tmp_path: Path) -> None:
    data = host_config(tmp_path, host={"max_receive_bytes": "3MiB", "max_frame_bytes": "8MiB",
                                       "request_timeout_s": 2.0})
    server = HostServer(config_from_dict(data)).start()
    path = str(data["host"]["socket"])
    engine = AttachedPool(engine_config(data, request_timeout_s=30.0))
    staller = _attached_raw(path)
    greedy = _attached_raw(path)
    try:
        assert _round_trip(engine, 1)
        # 2 MiB declared, 1 MiB sent, then silence: it holds 2 of the 3 MiB budget.
        staller.sendall(wire.HEADER.pack(2, 2 << 20) + b"{}" + bytes(1 << 20))
        wait_for(lambda: server._receiving == (2 << 20) + 2, 20, "the staller's frame admitted")
        # Another 2 MiB message does not fit: its connection is closed, nothing read.
        greedy.sendall(wire.HEADER.pack(2, 2 << 20))
        assert _closed_by_peer(greedy)
        assert server.refused_frames == 1
        assert _round_trip(engine, 2)  # small requests are not held up meanwhile
        # The staller misses host.request_timeout_s: its connection goes, the bytes come back.
        assert _closed_by_peer(staller)
        wait_for(lambda: server._receiving == 0, 20, "the staller's bytes released")
        late = _attached_raw(path)
        late.sendall(wire.HEADER.pack(2, 2 << 20) + b"{}" + bytes(2 << 20))
        answer, _, _ = wire.recv_frame(late, 0)  # received whole and answered (an op error)
        assert answer["ok"] is False and "unknown op" in answer["error"]
        late.close()
        assert server._receiving == 0
        # A large message before the attach is refused outright.
        rogue = _raw(path)
        rogue.sendall(wire.HEADER.pack(1 << 20, 0))
        answer, _, _ = wire.recv_frame(rogue, 0)
        assert answer["ok"] is False and "before the attach" in answer["error"]
        rogue.close()
    finally:
        for sock in (staller, greedy):
            sock.close()
        engine.close()
        server.stop()


def test_a_host_pool_out_of_descriptors_serves_again_once_they_are_freed(tmp_path: Path) -> None:
    """A real ``kvpool host`` whose descriptor limit is lowered under it: connections past it
    wait in the backlog (one warning, no crash), attached engines keep being served, and a new
    engine attaches once descriptors are free again."""
    data = host_config(tmp_path, host={"request_timeout_s": 60.0})
    host = start_host(tmp_path, data)
    path = str(data["host"]["socket"])
    engine_path = write_config(tmp_path, {**data, "host": {**data["host"], "retry_s": 0.1}},
                               "engine.yaml")
    engine = AttachedPool(engine_config(data))
    flood: list[socket.socket] = []
    try:
        assert _round_trip(engine, 1)
        started = time.monotonic()
        in_use = len(os.listdir(f"/proc/{host.pid}/fd"))
        resource.prlimit(host.pid, resource.RLIMIT_NOFILE, (in_use + 4, in_use + 4))
        for _ in range(12):  # past the limit: the rest wait in the listener's backlog
            with contextlib.suppress(OSError):
                flood.append(_raw(path))
        wait_for(lambda: "accept failed" in (tmp_path / "host.log").read_text(), 30,
                 "the host pool ran out of descriptors")
        assert host.proc is not None and host.proc.poll() is None  # still running
        assert _round_trip(engine, 2)  # the attached engine is served meanwhile
        for sock in flood:
            sock.close()
        flood = []
        wait_for(lambda: run_child("save", engine_path, "", 5, 2)["stored"] == 2, 60,
                 "a new engine attached once descriptors were freed")
        assert run_child("read", engine_path, "", 5, 2) == {"hits": 2, "same": True}
        log = (tmp_path / "host.log").read_text()
        # One warning per 10 s while it lasts, not one per failed accept.
        allowed = 1 + int((time.monotonic() - started) / 10)
        assert 1 <= log.count("accept failed") <= allowed, log[-2000:]
    finally:
        for sock in flood:
            sock.close()
        engine.close()
        host.stop()


def test_an_engine_of_another_wire_version_is_refused_with_both_versions_named(
        host: tuple[HostServer, dict[str, object]]) -> None:
    """A HELLO without the host pool's wire version (an engine of another kvpool release)
    is refused with a message naming both versions, and closed; the next engine attaches."""
    _, data = host
    path = str(data["host"]["socket"])  # type: ignore[index]
    for version in (None, wire.VERSION - 1, "2"):
        sock = _raw(path)
        hello: dict[str, object] = {"op": wire.HELLO, "token": None, "tenant": "default"}
        if version is not None:
            hello["version"] = version
        wire.send_frame(sock, hello)
        answer, _, fds = wire.recv_frame(sock, 0, want_fds=1)
        assert fds == [] and answer["ok"] is False, answer
        assert f"host wire version {version}" in answer["error"], answer
        assert f"this host pool {wire.VERSION}" in answer["error"], answer
        assert _closed_by_peer(sock)
        sock.close()
    _attached_raw(path).close()
