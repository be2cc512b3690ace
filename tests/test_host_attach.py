"""The host pool's attach protocol, with the server in this process (fast): an engine that
starts before its host pool, misuse on the socket, the peer checks, the byte fallbacks."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from host_child import chunks, namespace
from host_support import engine_config, host_config
from kvtest import wait_for

from kvpool.cli import main
from kvpool.config import config_from_dict, redact_secrets
from kvpool.errors import ArgumentError, UnknownNamespaceError
from kvpool.host import open_pool, wire
from kvpool.host.client import AttachedPool
from kvpool.host.server import HostServer, HostStartError
from kvpool.host.tenants import peer_allowed
from kvpool.keys import Namespace
from kvpool.pool import KVPool


def test_open_pool_is_embedded_unless_a_host_socket_is_set(tmp_path: Path) -> None:
    data = host_config(tmp_path)
    embedded = open_pool(config_from_dict({**data, "host": {}}))
    assert isinstance(embedded, KVPool)
    embedded.close()
    attached = open_pool(engine_config(data))  # nobody listens yet: detached, no error
    assert isinstance(attached, AttachedPool) and not attached.attached
    attached.close()


def test_engine_started_before_its_host_pool_misses_then_attaches(tmp_path: Path) -> None:
    data = host_config(tmp_path)
    pool = AttachedPool(engine_config(data))
    ns = pool.register_namespace(namespace())
    keys, datas = chunks(ns, 1, 2)
    assert pool.put_many(ns, keys, datas) == 0  # dropped, counted
    assert pool.get_many_into(ns, keys, [np.zeros_like(d) for d in datas]) == [False] * 2
    assert pool.lookup(ns, keys) == 0 and pool.pin_many(ns, keys) == [None, None]
    assert pool.stats()["attached"]["detached_drops"] == 2
    server = HostServer(config_from_dict(data)).start()
    try:
        wait_for(lambda: pool.put_many(ns, keys, datas) == 2, 20, "attached and stored")
        assert pool.lookup(ns, keys) == 2  # the namespace was registered on attach
        with pytest.raises(HostStartError, match="another host pool"):
            HostServer(config_from_dict(data))
    finally:
        pool.close()
        server.stop()
    assert not Path(data["host"]["socket"]).exists()


def test_misuse_on_the_socket_closes_only_that_connection(tmp_path: Path) -> None:
    data = host_config(tmp_path)
    server = HostServer(config_from_dict(data)).start()
    pool = AttachedPool(engine_config(data))
    try:
        ns = pool.register_namespace(namespace())
        keys, datas = chunks(ns, 1, 2)
        assert pool.put_many(ns, keys, datas) == 2
        other = namespace("x")
        with pytest.raises(UnknownNamespaceError):
            pool.lookup(other, keys)
        link = pool._link_now
        assert link is not None
        with pytest.raises(ArgumentError, match="unknown op"):
            link.call({"op": "nonsense"})
        with pytest.raises(ArgumentError, match="not registered on this connection"):
            link.call({"op": wire.LOOKUP, "ns": other.id.hex(), "n": 1}, keys[0])
        with pytest.raises(ArgumentError, match="key bytes"):
            link.call({"op": wire.LOOKUP, "ns": ns.id.hex(), "n": 3}, keys[0])
        # A peer that breaks the framing (a 4 GiB frame before its hello) is cut off.
        rogue = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        rogue.connect(data["host"]["socket"])
        rogue.sendall(wire.HEADER.pack(0xFFFFFFFF, 0xFFFFFFFF))
        rogue.settimeout(10)
        answer, _, _ = wire.recv_frame(rogue, 0)
        assert answer["ok"] is False
        assert rogue.recv(1) == b""
        rogue.close()
        outs = [np.zeros_like(d) for d in datas]
        assert pool.get_many_into(ns, keys, outs) == [True, True]  # the engine is unaffected
    finally:
        pool.close()
        server.stop()


def test_peer_uid_is_checked_before_any_token(tmp_path: Path) -> None:
    data = host_config(tmp_path)
    cfg = config_from_dict(data)
    assert peer_allowed(cfg, os.getuid()) and peer_allowed(cfg, 0)
    assert not peer_allowed(cfg, 65534)
    assert peer_allowed(config_from_dict({**data, "host": {**data["host"],
                                                            "allowed_uids": [65534]}}), 65534)
    if os.getuid() != 0:
        return  # the process check below needs to become another uid
    # A socket uid 65534 can reach (pytest's tmp_path is private to root).
    public = Path(tempfile.mkdtemp(prefix="kvpool-host-"))
    public.chmod(0o755)
    data["host"]["socket"] = str(public / "host.sock")
    server = HostServer(config_from_dict(data)).start()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only system calls, then _exit
        try:
            os.setuid(65534)
            peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            peer.connect(data["host"]["socket"])
            wire.send_frame(peer, {"op": wire.HELLO, "version": wire.VERSION,
                                   "tenant": "default"})
            answer, _, _ = wire.recv_frame(peer, 0)
            os.write(write_end, json.dumps(answer).encode())
        except BaseException as exc:
            os.write(write_end, json.dumps({"child": repr(exc)}).encode())
        finally:
            os._exit(0)
    try:
        os.close(write_end)
        os.waitpid(pid, 0)
        with os.fdopen(read_end) as got:
            answer = json.loads(got.read())
        assert answer.get("ok") is False and "uid 65534" in answer["error"], answer
    finally:
        server.stop()
        shutil.rmtree(public, ignore_errors=True)


def test_reads_fall_back_to_bytes_on_the_socket_when_every_slot_is_pinned(
        tmp_path: Path) -> None:
    data = host_config(tmp_path, ssd={"enabled": True, "capacity": "32MiB",
                                      "segment_size": "8MiB"},
                       pool={"promote_on_hit": False})
    server = HostServer(config_from_dict(data)).start()
    pool = AttachedPool(engine_config(data))
    try:
        ns = pool.register_namespace(namespace())
        cold, cold_datas = chunks(ns, 1, 4)
        assert pool.put_many(ns, cold, cold_datas) == 4
        assert pool.flush(30)
        hot, hot_datas = chunks(ns, 2, 8)  # fills DRAM's 8 slots: the cold ones go
        assert pool.put_many(ns, hot, hot_datas) == 8
        views = pool.pin_many(ns, hot)
        assert all(v is not None for v in views)
        outs = [np.zeros_like(d) for d in cold_datas]
        assert pool.get_many_into(ns, cold, outs) == [True] * 4  # from the SSD, as bytes
        assert all(np.array_equal(o, d) for o, d in zip(outs, cold_datas, strict=True))
        assert pool.stats()["attached"]["fallback_hits"] == 4
        for v in views:
            assert v is not None
            v.release()
        wait_for(lambda: pool.stats()["host"]["held"] == 0, 10, "pins released")
    finally:
        pool.close()
        server.stop()


def put_in_fours(pool: AttachedPool, ns: Namespace, keys: list[bytes],
                 datas: list[np.ndarray]) -> int:
    return sum(pool.put_many(ns, keys[i:i + 4], datas[i:i + 4]) for i in range(0, len(keys), 4))


def test_a_get_pins_its_chunks_as_one_batch_and_unpins_them_together(tmp_path: Path) -> None:
    """An attached get pins its DRAM hits under one pin id (fetching SSD-only chunks into free
    slots first); the bytes are the ones written, the pins count one per chunk against
    host.max_held, and once the get unpins them every slot is evictable again. Past
    max_held the get pins chunk by chunk and reads the rest as bytes."""
    data = host_config(tmp_path, ssd={"enabled": True, "capacity": "32MiB",
                                      "segment_size": "8MiB"},
                       pool={"promote_on_hit": False},
                       host={"max_held": 6, "direct_reads": False})  # reads pin here
    server = HostServer(config_from_dict(data)).start()
    pool = AttachedPool(engine_config(data))
    writer = AttachedPool(engine_config(data))
    try:
        ns = pool.register_namespace(namespace())
        writer.register_namespace(ns)
        cold, cold_datas = chunks(ns, 1, 2)
        assert writer.put_many(ns, cold, cold_datas) == 2
        assert writer.flush(30)
        hot, hot_datas = chunks(ns, 2, 8)  # DRAM's 8 slots: the cold ones are on SSD only
        assert put_in_fours(writer, ns, hot, hot_datas) == 8  # max_held: 6 reservations
        keys, datas = hot[:3] + cold, hot_datas[:3] + cold_datas  # 5 chunks: under max_held
        outs = [np.zeros_like(d) for d in datas]
        assert pool.get_many_into(ns, keys, outs) == [True] * 5
        assert all(np.array_equal(o, d) for o, d in zip(outs, datas, strict=True))
        attached = pool.stats()["attached"]
        assert attached["dram_hits"] == 5 and attached["fallback_hits"] == 0  # cold fetched
        assert pool.stats()["host"]["held"] == 0  # the stats request carried the unpin
        # all 8 slots evictable again: 8 new chunks fit
        new, new_datas = chunks(ns, 3, 8)
        assert put_in_fours(writer, ns, new, new_datas) == 8
        outs = [np.zeros_like(d) for d in new_datas]  # 8 chunks: past max_held
        assert pool.get_many_into(ns, new, outs) == [True] * 8
        assert all(np.array_equal(o, d) for o, d in zip(outs, new_datas, strict=True))
        attached = pool.stats()["attached"]
        assert attached["dram_hits"] == 5 + 6 and attached["fallback_hits"] == 2
        assert pool.stats()["host"]["held"] == 0
    finally:
        pool.close()
        writer.close()
        server.stop()


def test_released_pins_reach_the_host_pool_without_another_request(tmp_path: Path) -> None:
    data = host_config(tmp_path)
    server = HostServer(config_from_dict(data)).start()
    reader = AttachedPool(engine_config(data))
    writer = AttachedPool(engine_config(data))
    try:
        ns = reader.register_namespace(namespace())
        writer.register_namespace(ns)
        old, old_datas = chunks(ns, 1, 8)  # every slot of the arena
        assert writer.put_many(ns, old, old_datas) == 8
        views = reader.pin_many(ns, old)
        new, new_datas = chunks(ns, 2, 8)
        assert writer.put_many(ns, new, new_datas) == 0  # all pinned: dropped
        for v in views:
            assert v is not None
            v.release()
        # The reader sends nothing more: its flusher tells the host pool.
        wait_for(lambda: writer.put_many(ns, new, new_datas) == 8, 10,
                 "the released slots evictable again")
        assert reader.stats()["host"]["held"] == 0
        # Again after a pause long enough for the flusher to go to sleep: the release
        # wakes it.
        views = reader.pin_many(ns, new)
        time.sleep(0.5)
        for v in views:
            assert v is not None
            v.release()
        wait_for(lambda: writer.put_many(ns, old, old_datas) == 8, 10,
                 "the slots released after a pause evictable again")
    finally:
        reader.close()
        writer.close()
        server.stop()


def test_kvpool_host_refuses_to_start_without_a_socket_or_on_a_live_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = host_config(tmp_path)
    no_socket = tmp_path / "no-socket.yaml"
    no_socket.write_text(json.dumps({**data, "host": {}}))
    assert main(["host", "--config", str(no_socket)]) == 2
    assert "host.socket" in capsys.readouterr().err
    server = HostServer(config_from_dict(data)).start()
    try:
        live = tmp_path / "live.yaml"
        live.write_text(json.dumps(data))
        assert main(["host", "--config", str(live)]) == 2
        assert "another host pool is listening" in capsys.readouterr().err
    finally:
        server.stop()


def test_the_attach_token_is_printed_redacted(tmp_path: Path) -> None:
    cfg = engine_config(host_config(tmp_path), token="engine-secret")
    assert redact_secrets(cfg.model_dump())["host"]["token"] == "***"
