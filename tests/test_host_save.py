"""The pool's save / load pipeline through an attached engine (AttachedPool.save /
begin_save / open_load / load): what one engine saved is a hit for another, a read waits for
a commit another engine has in flight (bounded by pool.save_commit_wait_s), and a host pool
killed -9 costs misses and dropped saves, never an error or a hang."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
from host_child import chunks, namespace
from host_support import child, engine_config, host_config, run_child, start_host, write_config
from kvtest import wait_for

from kvpool.config import config_from_dict
from kvpool.host.client import AttachedPool
from kvpool.host.server import HostServer
from kvpool.keys import Namespace
from kvpool.saves import Fill


def _fill(datas: list[np.ndarray]) -> Fill:
    def fill(i: int, view: memoryview) -> None:
        view[:] = memoryview(datas[i]).cast("B")
    return fill


def _blocked_by(gate: threading.Event) -> Fill:
    def fill(i: int, view: memoryview) -> None:
        gate.wait(10)
    return fill


def _load(pool: AttachedPool, ns: Namespace, keys: list[bytes], outs: list[np.ndarray]) -> int:
    def scatter(i: int, view: memoryview) -> None:
        outs[i][:] = np.frombuffer(view, np.uint8)
    return pool.load(ns, keys, scatter)


def test_a_commit_in_flight_in_one_engine_is_waited_for_by_another(tmp_path: Path) -> None:
    data = host_config(tmp_path, pool={"save_commit_wait_s": 1.0})
    server = HostServer(config_from_dict(data)).start()
    a, b = AttachedPool(engine_config(data)), AttachedPool(engine_config(data))
    try:
        ns = a.register_namespace(namespace())
        b.register_namespace(namespace())
        keys, datas = chunks(ns, 1, 2)
        other, _ = chunks(ns, 2, 1)
        for release_after_s, expect in ((0.3, 2), (None, 0)):
            gate = threading.Event()
            # A's committer is kept busy by a deferred save whose fill waits for the gate,
            # so A's next commit stays in flight (handed over, not published) meanwhile.
            a.save(ns, other, _blocked_by(gate), defer=True)
            batch = a.begin_save(ns, keys)
            assert batch.reserved == 2
            assert b.lookup(ns, keys) == 2  # counted for every engine from the reservation
            for view, d in zip(batch.views, datas, strict=True):
                assert view is not None
                view[:] = memoryview(d).cast("B")
            waits = b.stats()["saves"]["load_commit_waits"]
            assert a.pin_many(ns, keys) == [None, None]  # its own: a miss, not waited for
            assert b.stats()["saves"]["load_commit_waits"] == waits
            ticket = batch.commit()
            assert b.contains_many(ns, keys) == [True, True]
            if release_after_s is not None:
                threading.Timer(release_after_s, gate.set).start()
            outs = [np.zeros_like(d) for d in datas]
            started = time.monotonic()
            loaded = _load(b, ns, keys, outs)
            waited = time.monotonic() - started
            gate.set()
            assert loaded == expect
            assert all(np.array_equal(o, d) for o, d in zip(outs[:loaded], datas, strict=False))
            assert waited < 8  # bounded by save_commit_wait_s, never a hang
            assert ticket.wait(10) and ticket.stored == 2
            assert _load(b, ns, keys, outs) == 2  # published now
            a.delete(ns, keys[0])
            a.delete(ns, keys[1])
            a.delete(ns, other[0])
        aborted = a.begin_save(ns, keys)
        assert b.lookup(ns, keys) == 2
        aborted.abort()
        # an aborted save is no longer counted (the abort travels without an answer)
        wait_for(lambda: b.lookup(ns, keys) == 0, 10, "the abort reached the host pool")
        stats = b.stats()
        assert stats["saves"]["load_commit_timeouts"] >= 1  # the host pool's count
        assert a.stats()["attached"]["saves"]["save_stored"] >= 4
    finally:
        a.close()
        b.close()
        server.stop()


def test_one_process_saves_another_loads_then_the_host_pool_killed_costs_only_misses(
        tmp_path: Path) -> None:
    data = host_config(tmp_path)
    host = start_host(tmp_path, data)
    engine = write_config(tmp_path, data, "engine.yaml")
    pool = AttachedPool(engine_config(data))
    server: HostServer | None = None
    try:
        assert run_child("psave", engine, "", 7, 4) == {"stored": 4, "present": 0}
        assert run_child("pload", engine, "", 7, 4) == {"hits": 4, "same": True, "present": 4}
        ns = pool.register_namespace(namespace())
        keys, datas = chunks(ns, 3, 3)
        assert pool.save(ns, keys, _fill(datas)).wait(10)
        host.kill()
        outs = [np.zeros_like(d) for d in datas]
        assert _load(pool, ns, keys, outs) == 0
        ticket = pool.save(ns, keys, _fill(datas))
        assert ticket.wait(10) and ticket.stored == 0
        with pool.open_load(ns, keys) as handle:
            assert handle.loaded == 0
        server = HostServer(config_from_dict(data)).start()  # back (in this process: faster)

        def saved() -> bool:
            t = pool.save(ns, keys, _fill(datas))
            return t.wait(10) and t.stored == 3
        wait_for(saved, 30, "re-attached and saved")
        assert _load(pool, ns, keys, outs) == 3
        assert all(np.array_equal(o, d) for o, d in zip(outs, datas, strict=True))
        assert pool.stats()["attached"]["attaches"] >= 2
    finally:
        pool.close()
        host.stop()
        if server is not None:
            server.stop()


def test_an_engine_killed_mid_save_is_no_longer_waited_for(tmp_path: Path) -> None:
    data = host_config(tmp_path)
    server = HostServer(config_from_dict(data)).start()
    pool = AttachedPool(engine_config(data))
    proc = child("saving", write_config(tmp_path, data, "engine.yaml"), 5, 3)
    try:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline()) == {"holding": True, "reserved": 3}
        ns = pool.register_namespace(namespace())
        keys, datas = chunks(ns, 5, 3)
        assert pool.lookup(ns, keys) == 3  # being saved by the child
        proc.kill()
        proc.wait(30)
        # its reservations and their marks died with its connection: misses, free slots
        wait_for(lambda: pool.lookup(ns, keys) == 0, 20, "the dead engine's save ended")
        with pool.open_load(ns, keys) as handle:
            assert handle.loaded == 0
        ticket = pool.save(ns, keys, _fill(datas))
        assert ticket.wait(10) and ticket.stored == 3
        outs = [np.zeros_like(d) for d in datas]
        assert _load(pool, ns, keys, outs) == 3
        assert all(np.array_equal(o, d) for o, d in zip(outs, datas, strict=True))
    finally:
        if proc.poll() is None:
            proc.kill()
        pool.close()
        server.stop()
