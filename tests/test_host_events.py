"""A host pool's KV events and query API (issue 26, items 1-2), with real processes:
``kvpool host`` as a child process, engine processes (tests/host_child.py) saving chunks
into it, an EventConsumer following its one publisher, /query and /query_by_hash over HTTP;
the host pool killed with SIGKILL and restarted."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request
from functools import partial
from pathlib import Path

from events_support import Follower, free_port, get_json, post_json
from host_child import chunks, namespace
from host_support import host_config, run_child, start_host, write_config
from kvtest import wait_for
from node_process import NodeProcess
from prometheus_client.parser import text_string_to_metric_families

from kvpool.config import config_from_dict
from kvpool.events.consumer import RESET_RESTART
from kvpool.events.sink import MEDIUM_CPU, MEDIUM_DISK
from kvpool.host.server import HostServer
from kvpool.keys import Namespace
from kvpool.tiers.dram import DramTier

TOKENS = 128  # host_child's chunk_tokens


def _tokens(seed: int, n: int) -> list[int]:
    base = seed * 1_000_000  # as host_child.chunks
    return list(range(base, base + n * TOKENS))


def _query(port: int, ns: Namespace, seed: int, n: int, **extra: object) -> tuple[int, dict]:
    return post_json(port, "/query", {"namespace_id": ns.id.hex(), "block_size": TOKENS,
                                      "token_ids": _tokens(seed, n), **extra})


def test_host_pool_events_follow_dram_and_ssd_and_restarts(tmp_path: Path) -> None:
    metrics = free_port()
    events = {"port": free_port(), "replay_port": free_port(), "batch_interval_s": 0.02,
              "node_id": "host-a"}
    data = host_config(tmp_path, ssd={"enabled": True, "capacity": "32MiB",
                                      "segment_size": "8MiB"},
                       server={"metrics_port": metrics}, events=events)
    config = write_config(tmp_path, data, "engine.yaml")
    host = start_host(tmp_path, data)
    follower: Follower | None = None
    try:
        info = get_json(metrics, "/events")
        assert info["node"] == "host-a" and info["key_scope"] == ""
        assert info["endpoint"] == f"tcp://127.0.0.1:{events['port']}"
        follower = Follower(info)
        ns = namespace()
        first, _ = chunks(ns, 1, 4)
        cpu = partial(follower.held, "host-a", MEDIUM_CPU, ns)
        disk = partial(follower.held, "host-a", MEDIUM_DISK, ns)

        assert run_child("save", config, "", 1, 4) == {"stored": 4}
        wait_for(lambda: cpu() == disk() == set(first), 30,
                 "the engine's four chunks announced in DRAM and on SSD")
        assert follower.stored and all(e.tenant is None for e in follower.stored)
        assert {e.block_size for e in follower.stored} == {TOKENS}
        # 8 DRAM slots, 12 chunks: at least 4 leave DRAM and stay on SSD.
        second, _ = chunks(ns, 2, 8)
        assert run_child("save", config, "", 2, 8) == {"stored": 8}
        wait_for(lambda: disk() == set(first + second) and len(cpu()) <= 8, 30,
                 "evictions from DRAM announced removed")
        assert cpu() < set(first + second)

        # The query API says what the events say, per medium, in tokens.
        for seed, keys in ((1, first), (2, second)):
            status, answer = _query(metrics, ns, seed, len(keys))
            assert status == 200, answer
            mine = answer["default"]["host-a"]
            assert mine["DISK"] == mine["longest_matched"] == len(keys) * TOKENS
            assert mine["CPU"] == follower.prefix("host-a", MEDIUM_CPU, ns, keys) * TOKENS
            assert mine["incarnation"] == info["incarnation"]
        status, answer = post_json(metrics, "/query_by_hash", {
            "model": "host-test", "seq_hashes": [k.hex() for k in first], "tenant_id": "x"})
        assert status == 200 and answer["x"]["host-a"]["DISK"] == 4 * TOKENS
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10) as r:
            published = {m.labels["medium"]: m.value for f in text_string_to_metric_families(
                r.read().decode()) for m in f.samples
                if m.name == "kvpool_events_published_total"}
        assert published["CPU"] > 0 and published["DISK"] > 0

        host.kill()  # SIGKILL; the same events ports on restart
        host = start_host(tmp_path, data)
        restarted = get_json(metrics, "/events")
        assert restarted["incarnation"] != info["incarnation"]
        assert run_child("save", config, "", 3, 1) == {"stored": 1}
        third, _ = chunks(ns, 3, 1)
        wait_for(lambda: set(third) <= cpu(), 30, "the new incarnation's events")
        assert follower.resets == [("host-a", RESET_RESTART)]
        assert not disk() & set(first)  # the old incarnation's state dropped
        # What the SSD recovered is not announced; the query API still finds it.
        status, answer = _query(metrics, ns, 1, 4)
        assert answer["default"]["host-a"]["DISK"] == 4 * TOKENS
        assert answer["default"]["host-a"]["incarnation"] == restarted["incarnation"]
    finally:
        if follower is not None:
            follower.close()
        assert host.stop() == 0


def test_two_tenants_events_name_their_tenant_and_queries_pick_its_pool(
        tmp_path: Path) -> None:
    metrics = free_port()
    data = host_config(tmp_path, server={"metrics_port": metrics, "auth": [
        {"token": "token-a-secret", "tenants": ["a"]},
        {"token": "token-b-secret", "tenants": ["b"]}]}, events={"batch_interval_s": 0.02})
    host = start_host(tmp_path, data)
    engine_a = write_config(tmp_path, {**data, "host": {
        **data["host"], "tenant": "a", "token": "token-a-secret"}}, "engine-a.yaml")
    engine_b = write_config(tmp_path, {**data, "host": {
        **data["host"], "tenant": "b", "token": "token-b-secret"}}, "engine-b.yaml")
    info = get_json(metrics, "/events")
    node = info["node"]
    assert node == socket.gethostname()  # events.node_id unset
    follower = Follower(info)
    try:
        ns_a, ns_b = namespace("a"), namespace("b")
        keys_a, _ = chunks(ns_a, 1, 3)
        keys_b, _ = chunks(ns_b, 1, 2)
        assert run_child("save", engine_a, "a", 1, 3) == {"stored": 3}
        assert run_child("save", engine_b, "b", 1, 2) == {"stored": 2}

        wait_for(lambda: follower.held(node, MEDIUM_CPU, ns_a) == set(keys_a)
                 and follower.held(node, MEDIUM_CPU, ns_b) == set(keys_b), 30,
                 "both tenants' chunks announced by the one publisher")
        assert {(e.tenant, bytes(e.namespace_id or b"")) for e in follower.stored} == \
            {("a", ns_a.id), ("b", ns_b.id)}
        assert follower.tenant(node, ns_a) == "a" and follower.tenant(node, ns_b) == "b"

        status, answer = _query(metrics, ns_a, 1, 3, tenant_id="a")
        assert status == 200 and answer["a"][node]["CPU"] == 3 * TOKENS, answer
        # Tenant b's pool does not hold tenant a's namespace.
        status, answer = _query(metrics, ns_a, 1, 3, tenant_id="b")
        assert status == 200 and answer["b"][node]["longest_matched"] == 0
        status, answer = post_json(metrics, "/query", {"model": "host-test",
                                                       "token_ids": _tokens(1, 2),
                                                       "tenant_id": "b"})
        assert status == 200 and answer["b"][node]["CPU"] == 2 * TOKENS, answer
        # Bad requests are 400s that say why.
        status, answer = _query(metrics, ns_a, 1, 3, tenant_id="c")
        assert status == 400 and "'c'" in answer["error"]
        status, answer = _query(metrics, ns_a, 1, 3)  # no tenant_id: "default", unknown
        assert status == 400 and "'default'" in answer["error"]
        status, answer = post_json(metrics, "/query", {"tenant_id": "a", "token_ids": 5,
                                                       "namespace_id": ns_a.id.hex()})
        assert status == 400 and "token_ids" in answer["error"]
        status, answer = post_json(metrics, "/query_by_hash", {"tenant_id": "a",
                                                               "model": "no-such-model",
                                                               "seq_hashes": []})
        assert status == 400 and "no-such-model" in answer["error"]
        status, answer = _query(metrics, ns_a, 1, 3, tenant_id="a", scope="cluster")
        assert status == 400 and "cluster" in answer["error"]
    finally:
        follower.close()
        assert host.stop() == 0


def test_an_events_port_in_use_is_a_one_line_exit_2(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        data = host_config(tmp_path, events={"port": port})
        path = write_config(tmp_path, data)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
        done = subprocess.run([sys.executable, "-m", "kvpool.cli", "host", "--config",
                               str(path)], capture_output=True, text=True, timeout=120,
                              env=env)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"events.port={port}" in lines[0] \
        and "events.replay_port=0" in lines[0], done.stderr
    assert not Path(data["host"]["socket"]).exists()  # nothing left listening


def test_the_cluster_tier_is_a_query_medium_not_an_event_one(tmp_path: Path,
                                                              node: NodeProcess) -> None:
    metrics = free_port()
    data = host_config(tmp_path, server={"metrics_port": metrics},
                       cluster={"nodes": [node.address], "retry_down_s": 0.2},
                       events={"batch_interval_s": 0.02, "node_id": "host-a"})
    config = write_config(tmp_path, data, "engine.yaml")
    host = start_host(tmp_path, data)
    follower = Follower(get_json(metrics, "/events"))
    try:
        ns = namespace()
        keys, _ = chunks(ns, 1, 3)
        assert run_child("save", config, "", 1, 3) == {"stored": 3}

        def remote() -> object:
            status, answer = _query(metrics, ns, 1, 3)
            assert status == 200, answer
            return answer["default"]["host-a"].get("REMOTE")

        wait_for(lambda: remote() == 3 * TOKENS, 30,
                 "the host pool's saves reached the node, and the query asks the node")
        wait_for(lambda: follower.held("host-a", MEDIUM_CPU, ns) == set(keys), 30,
                 "the DRAM events")
        # The node announces its own copies (under its node id); the host pool does not
        # announce them again as REMOTE.
        assert {e.medium for e in follower.stored} == {MEDIUM_CPU}
        node.kill9()  # a dead node is a miss in the answer, never an error
        assert remote() == 0
    finally:
        follower.close()
        assert host.stop() == 0


def test_tenant_pools_never_start_a_publisher_of_their_own(tmp_path: Path) -> None:
    auth = [{"token": "token-a-secret", "tenants": ["a", "b"]}]
    for enabled in (False, True):
        base = tmp_path / str(enabled)
        server = HostServer(config_from_dict(host_config(
            base, server={"auth": auth}, events={"enabled": enabled})))
        try:
            pools = server.tenants.pools()
            assert [t.name for t in pools] == ["a", "b"]
            assert all(t.pool.events is None for t in pools)
            drams = [tier for t in pools for tier in t.pool.tiers()
                     if isinstance(tier, DramTier)]
            assert len(drams) == 2
            if enabled:  # one publisher; each tenant's DRAM holds a sink of it
                assert server.events is not None
                assert all(d.events is not None for d in drams)
            else:
                assert server.events is None and all(d.events is None for d in drams)
        finally:
            server.stop()
