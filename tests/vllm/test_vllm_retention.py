"""Retention through the vLLM connector's two sides (no vLLM needed: the scheduler side and
the worker side are driven as vLLM drives them): the engine's retention from the extra
config, a request's from ``kv_transfer_params``, pins refused past the bound (counted, saved
unpinned), ephemeral saves kept off the SSD, and ``release_session``."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from kvtest import stop_process
from node_process import NodeProcess
from test_vllm_plan import TABLE
from test_vllm_worker import BLOCK, IDENT, NBLOCKS, caches

from kvpool.errors import ConfigError
from kvpool.integrations.vllm.lookup import LookupServer
from kvpool.integrations.vllm.plan import ChunkCopy, ReqTransfer
from kvpool.integrations.vllm.scheduler import SchedulerSide
from kvpool.integrations.vllm.settings import parse_settings
from kvpool.integrations.vllm.worker import WorkerSide
from kvpool.keys import KVLayout, Namespace
from kvpool.net.connection import NodeConnection


def test_scheduler_carries_each_requests_retention_over_the_engines() -> None:
    sched = SchedulerSide(parse_settings({"chunk_tokens": 256,
                                          "retention": {"priority": "high", "ttl_s": 60}}, 128))
    server = LookupServer(lambda keys: 0)
    sched.set_workers([(Namespace("m", KVLayout("uint8", 1, 1, 1024, 1, kv_factor=1)),
                        server.address)])
    requests = {
        "plain": None,
        "pinned": {"retention": {"priority": "pin", "session": "conv-1"}},
        "bad": {"retention": {"priority": "urgent"}},  # logged, the engine's applies
        "ender": {"release_session": "conv-0", "release_delete": True},
    }
    for req_id, params in requests.items():
        sched.after_alloc(SimpleNamespace(request_id=req_id, prompt_token_ids=list(range(600)),
                                          kv_transfer_params=params), 0)
    _, stores = sched.build(dict.fromkeys(requests, 600), dict.fromkeys(requests, 0),
                            lambda _: TABLE)
    got = {t.req_id: t.retention for t in stores}
    engine = {"priority": "high", "ttl_s": 60}
    assert got == {"plain": engine, "bad": engine, "ender": engine,
                   "pinned": {"priority": "pin", "ttl_s": 60, "session": "conv-1"}}
    assert sched.take_releases() == [("conv-0", True)]
    assert sched.take_releases() == []
    sched.close()
    server.close()
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.retention"):
        parse_settings({"retention": {"ttl_s": -5}}, 128)


def save(w: WorkerSide, kv: dict[str, torch.Tensor], req_id: str, key: bytes,
         retention: dict[str, Any] | None) -> None:
    store = [ReqTransfer(req_id, (ChunkCopy((key,), (1, 2)),), retention)]
    for name in sorted(kv):
        w.save_layer(name, kv[name], store)
    w.end_step()
    assert w.flush(10)


def test_worker_saves_with_retention_and_releases_sessions(tmp_path: Path) -> None:
    chunk = 2 * BLOCK
    settings = parse_settings({"chunk_tokens": chunk, "config": {
        "cache_dir": str(tmp_path), "dram": {"capacity": "8MiB", "slab_size": "1MiB"},
        "ssd": {"capacity": "16MiB", "segment_size": "4MiB"},
        "pool": {"ssd_write": "through", "max_pinned_fraction": 0.0}}}, BLOCK)
    w = WorkerSide(settings, IDENT, 0, 1, num_blocks=NBLOCKS)
    kv = caches(0)
    try:
        w.register(kv)
        assert w.ns is not None
        ns = w.ns
        pinned, fleeting, session = b"p" * 16, b"e" * 16, b"s" * 16
        save(w, kv, "r1", pinned, {"priority": "pin"})  # past the bound: refused, saved
        assert w.stats.counters.pins_refused == 1
        assert w.pool.contains(ns, pinned)
        assert w.pool.stats()["retention"]["pinned_bytes"] == 0
        save(w, kv, "r2", fleeting, {"priority": "ephemeral"})
        ssd = w.pool._stack.ssd
        assert ssd is not None
        assert w.pool.contains(ns, fleeting) and not ssd.contains_many([fleeting], ns.id)[0]
        save(w, kv, "r3", session, {"priority": "high", "session": "conv-1"})
        assert w.pool.contains(ns, session)
        w.release([("conv-1", True)])
        assert w.flush(10)
        assert not w.pool.contains(ns, session)
        assert w.stats.counters.sessions_released == 1
    finally:
        w.close()


def test_retain_and_release_to_the_nodes_run_on_the_save_thread_not_the_step(
        tmp_path: Path) -> None:
    """With storage nodes a request's retention is a RETAIN per node and a session's end a
    RELEASE per node. The step hands both to the pool's save thread: a node that does not
    answer (SIGSTOP) holds the commit, never the engine's step; once it answers the node
    holds the pin, then lets it go."""
    chunk = 2 * BLOCK
    with NodeProcess(tmp_path / "node", ssd={"enabled": False}) as node:
        assert node.proc is not None
        pid = node.proc.pid
        settings = parse_settings({"chunk_tokens": chunk, "config": {
            "cache_dir": str(tmp_path / "engine"), "dram": {"capacity": "8MiB",
                                                            "slab_size": "1MiB"},
            "ssd": {"enabled": False},
            # long enough that the stopped node is still waited for when the step returns
            "cluster": {"nodes": [node.address], "request_timeout_s": 300}}}, BLOCK)
        w = WorkerSide(settings, IDENT, 0, 1, num_blocks=NBLOCKS)
        kv = caches(0)
        conn = NodeConnection(node.address)
        try:
            ns = w.register(kv)
            pinned = b"n" * 16
            stop_process(pid)
            try:
                store = [ReqTransfer("r1", (ChunkCopy((pinned,), (1, 2)),),
                                     {"priority": "pin", "session": "conv-9"})]
                for name in sorted(kv):
                    w.save_layer(name, kv[name], store)
                w.end_step()  # returns: the RETAIN waits on the save thread
                assert w.pool.saving_many(ns, [pinned]) == [True]
                assert w.pool.lookup(ns, [pinned]) == 1  # read-your-writes meanwhile
            finally:
                os.kill(pid, signal.SIGCONT)
            assert w.flush(60)
            assert w.pool.contains(ns, pinned)
            assert (w.stats.counters.stored_chunks, w.stats.counters.pins_refused) == (1, 0)
            assert w.pool.stats()["retention"]["pinned_bytes"] == ns.chunk_bytes
            assert conn.stats()["retention"]["pinned_bytes"] == ns.chunk_bytes
            stop_process(pid)
            try:
                w.release([("conv-9", False)])  # returns: the RELEASE waits on the save thread
                assert w.stats.counters.sessions_released == 0
            finally:
                os.kill(pid, signal.SIGCONT)
            assert w.flush(60)
            assert w.stats.counters.sessions_released == 1
            assert w.pool.stats()["retention"]["pinned_bytes"] == 0
            assert conn.stats()["retention"]["pinned_bytes"] == 0
            assert w.pool.contains(ns, pinned)  # released, not deleted
        finally:
            conn.close()
            w.close()
