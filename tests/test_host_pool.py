"""The host pool with real processes: ``kvpool host`` and engine processes attached to it
(tests/host_child.py), killed with SIGKILL (issue 23 item 2)."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from host_child import chunks, namespace
from host_support import child, engine_config, host_config, run_child, start_host, write_config
from kvtest import stop_process, wait_for

from kvpool.bench.remote_peers import free_port
from kvpool.errors import ArgumentError
from kvpool.host.client import AttachedPool
from kvpool.host.link import AttachError


def _http(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as err:
        return int(err.code), ""


def test_two_attached_processes_share_hits_and_one_copy(tmp_path: Path) -> None:
    port = free_port()
    data = host_config(tmp_path, server={"metrics_port": port}, metrics={"enabled": True})
    host = start_host(tmp_path, data)
    config = write_config(tmp_path, data, "engine.yaml")
    try:
        # The DaemonSet's probes, and the tenant pool's figures.
        assert _http(f"http://127.0.0.1:{port}/healthz") == (200, "ok\n")
        assert _http(f"http://127.0.0.1:{port}/readyz") == (200, "ready\n")
        assert run_child("save", config, "", 1, 4) == {"stored": 4}
        with AttachedPool(engine_config(data)) as pool:  # this process: another engine
            ns = pool.register_namespace(namespace())
            keys, datas = chunks(ns, 1, 4)
            outs = [np.zeros_like(d) for d in datas]
            assert pool.get_many_into(ns, keys, outs) == [True] * 4
            assert all(np.array_equal(o, d) for o, d in zip(outs, datas, strict=True))
            assert pool.put_many(ns, keys, datas) == 4  # already stored: no second copy
            assert pool.stats()["dram"]["used_bytes"] == 4 << 20
            views = pool.pin_many(ns, keys)
            assert all(v is not None and np.array_equal(np.frombuffer(v.data, np.uint8), d)
                       for v, d in zip(views, datas, strict=True))
            for v in views:
                assert v is not None
                v.release()
        status, text = _http(f"http://127.0.0.1:{port}/metrics")
        assert status == 200 and "kvpool_lookups_total" in text
        assert "kvpool_read_directory_chunks 4.0" in text  # the 4 chunks, read directly
        assert "kvpool_read_directory_full_total 0.0" in text
    finally:
        assert host.stop() == 0


def test_sigkilled_engine_leaks_no_pin_and_no_reservation(tmp_path: Path) -> None:
    data = host_config(tmp_path)
    host = start_host(tmp_path, data)
    config = write_config(tmp_path, data, "engine.yaml")
    holder = None
    try:
        with AttachedPool(engine_config(data)) as pool:
            ns = pool.register_namespace(namespace())
            old, old_datas = chunks(ns, 1, 2)
            assert pool.put_many(ns, old, old_datas) == 2
            holder = child("hold", config, 1, 2, 4)
            assert holder.stdout is not None
            held = json.loads(holder.stdout.readline())
            assert held == {"holding": True, "pinned": 2, "reserved": 4}
            # 8 slots: 2 pinned, 4 reserved by the holder: new chunks evict each other.
            first, first_datas = chunks(ns, 5, 8)
            pool.put_many(ns, first, first_datas)
            assert sum(pool.contains_many(ns, first)) <= 2
            assert pool.contains_many(ns, old) == [True, True]
            os.kill(holder.pid, signal.SIGKILL)
            holder.wait(30)
            # The host pool released the dead connection's pins and reservations: all 8
            # slots take new chunks again, and nothing half-written was published.
            second, second_datas = chunks(ns, 6, 8)

            def all_stored() -> bool:
                pool.put_many(ns, second, second_datas)
                return all(pool.contains_many(ns, second))

            wait_for(all_stored, 30, "8 new chunks resident after the holder died")
            reserved, _ = chunks(ns, 2, 4)
            assert pool.contains_many(ns, reserved) == [False] * 4
            assert pool.contains_many(ns, old) == [False, False]  # unpinned, then evicted
            outs = [np.zeros_like(d) for d in second_datas]
            assert all(pool.get_many_into(ns, second, outs))
            assert all(np.array_equal(o, d) for o, d in zip(outs, second_datas, strict=True))
            assert pool.stats()["host"]["held"] == 0
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
        host.stop()


def test_host_pool_killed_and_restarted_costs_misses_not_errors(tmp_path: Path) -> None:
    data = host_config(tmp_path, ssd={"enabled": True, "capacity": "32MiB",
                                      "segment_size": "8MiB"},
                       dram={"capacity": "16MiB"})
    host = start_host(tmp_path, data)
    config = write_config(tmp_path, data, "engine.yaml")
    stop = tmp_path / "stop"
    load = child("load", config, stop)
    try:
        assert load.stdout is not None
        assert json.loads(load.stdout.readline()) == {"started": True}
        host.kill()  # SIGKILL under load: its socket file stays behind
        assert Path(data["host"]["socket"]).exists()
        time.sleep(1)
        host = start_host(tmp_path, data)  # replaces the stale socket
        time.sleep(3)
        stop.touch()
        out, _ = load.communicate(timeout=120)
        result = json.loads(out.strip().splitlines()[-1])
        assert result["errors"] == []
        assert result["attached"] is True and result["attaches"] >= 2
        assert result["hits"] > 0
        # Never waits past the request timeout (3 s) by much: misses, not a hang.
        assert result["slowest_s"] < 20
        assert run_child("read", config, "", 99, 4)["hits"] == 4  # served after restart
    finally:
        if load.poll() is None:
            load.kill()
        host.stop()


def test_two_tenants_on_one_host_pool_see_only_their_own_chunks(tmp_path: Path) -> None:
    data = host_config(tmp_path, server={"auth": [
        {"token": "token-a-secret", "tenants": ["a"]},
        {"token": "token-b-secret", "tenants": ["b"]}]})
    host = start_host(tmp_path, data)
    try:
        a = AttachedPool(engine_config(data, tenant="a", token="token-a-secret"))
        b = AttachedPool(engine_config(data, tenant="b", token="token-b-secret"))
        ns_a = a.register_namespace(namespace("a"))
        keys, datas = chunks(ns_a, 3, 2)
        assert a.put_many(ns_a, keys, datas) == 2
        with pytest.raises(ArgumentError, match="tenant"):
            b.register_namespace(namespace("a"))
        ns_b = b.register_namespace(namespace("b"))
        assert b.lookup(ns_b, chunks(ns_b, 3, 2)[0]) == 0
        # Each tenant maps its own arena: A's bytes are in A's mapping and not in B's.
        probe = datas[0][:4096].tobytes()
        assert a._link_now is not None and b._link_now is not None
        assert a._link_now.mapping.find(probe) >= 0
        assert b._link_now.mapping.find(probe) == -1
        with pytest.raises(AttachError, match="token refused"):
            AttachedPool(engine_config(data, tenant="a", token="token-b-secret"))
        with pytest.raises(AttachError, match="token refused"):
            AttachedPool(engine_config(data, tenant="a", token=None))
        a.close()
        b.close()
    finally:
        host.stop()


@pytest.mark.parametrize("direct", [False, True], ids=["pinned-reads", "direct-reads"])
def test_a_paused_host_pool_costs_misses_after_the_request_timeout_then_serves_again(
        tmp_path: Path, direct: bool) -> None:
    """SIGSTOP, not SIGKILL: the socket stays open and nothing answers. A read that asks the
    host pool gives up at host.request_timeout_s (misses, not a hang, not an error), and once
    the host pool runs again the engine attaches again and hits what it stored before. With
    direct reads, the chunks the read directory shows are read without asking: they stay
    hits, with their bytes, while the host pool is paused; only the chunk it lacks asks."""
    data = host_config(tmp_path, host={"request_timeout_s": 1.0, "direct_reads": direct})
    host = start_host(tmp_path, data)
    pool = AttachedPool(engine_config(data))
    try:
        ns = pool.register_namespace(namespace())
        keys, datas = chunks(ns, 3, 4)
        assert pool.put_many(ns, keys, datas) == 4
        absent = chunks(ns, 9, 1)[0]
        outs = [np.empty_like(d) for d in datas] + [np.empty_like(datas[0])]
        assert host.proc is not None
        # every thread stopped before the read: kill() returns before the group stop reaches
        # them, and a host thread still running could answer it (CI saw 4 hits so)
        stop_process(host.proc.pid)
        try:
            started = time.monotonic()
            assert pool.get_many_into(ns, keys + absent, outs) == [direct] * 4 + [False]
            assert time.monotonic() - started < 10
            if direct:
                assert all(np.array_equal(o, d) for o, d in zip(outs, datas, strict=False))
        finally:
            os.kill(host.proc.pid, signal.SIGCONT)
        outs = outs[:4]
        wait_for(lambda: pool.get_many_into(ns, keys, outs) == [True] * 4, 20,
                 "hits again once the host pool runs")
        assert all(np.array_equal(o, d) for o, d in zip(outs, datas, strict=True))
    finally:
        pool.close()
        host.stop()
