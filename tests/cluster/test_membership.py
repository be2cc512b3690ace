"""Membership against a real etcd: registration, watches, TTL expiry, etcd outages."""

from __future__ import annotations

import http.server
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from etcd_fixture import EtcdServer, free_port
from kvtest import wait_for

from kvpool.cluster import (
    EtcdClient,
    EtcdError,
    EtcdMembership,
    Membership,
    NodeInfo,
    NodeRegistration,
    StaticMembership,
    list_nodes,
    nodes_prefix,
)
from kvpool.cluster.membership import drained_key
from kvpool.errors import KVPoolError

REGISTRANT = Path(__file__).with_name("registrant.py")




def ids(nodes: list[NodeInfo]) -> list[str]:
    return [n.node_id for n in nodes]


def node(i: int) -> NodeInfo:
    return NodeInfo(f"node-{i}", "127.0.0.1", 7000 + i)


# -- no etcd needed -----------------------------------------------------------------------------


def test_node_info_json_round_trip_and_address() -> None:
    n = NodeInfo("a", "10.0.0.1", 7001)
    assert n.address() == "10.0.0.1:7001"
    assert NodeInfo.from_json(n.to_json()) == n
    assert NodeInfo("b", "::1", 1).address() == "[::1]:1"
    for bad in (b"nope", b"[]", b'{"node_id": "a"}', b'{"node_id": "a", "host": "h", "port": 0}'):
        with pytest.raises(ValueError):
            NodeInfo.from_json(bad)
    with pytest.raises(ValueError):
        NodeInfo("a/b", "h", 1)


def test_static_membership() -> None:
    m = StaticMembership(["10.0.0.2:7000", "10.0.0.1:7000", "[::1]:9", "10.0.0.1:7000"])
    assert isinstance(m, Membership)
    assert [n.address() for n in m.live_nodes()] == ["10.0.0.1:7000", "10.0.0.2:7000", "[::1]:9"]
    assert m.live_nodes()[0] == NodeInfo("10.0.0.1:7000", "10.0.0.1", 7000)
    m.close()
    for bad in ("nohost", "h:notaport", "h:70000", ":1"):
        with pytest.raises(ValueError):
            StaticMembership([bad])


def test_cluster_names_are_checked() -> None:
    assert nodes_prefix("prod") == "/kvpool/prod/nodes/"
    for bad in ("", "a/b", " a"):
        with pytest.raises(ValueError):
            nodes_prefix(bad)


def test_unreachable_endpoints_raise_clear_errors() -> None:
    dead = [f"http://127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    with pytest.raises(EtcdError) as info:
        EtcdMembership(dead, "c", timeout_s=0.5)
    message = str(info.value)
    assert isinstance(info.value, KVPoolError)
    assert dead[0] in message and "http://" + dead[1] in message
    assert "connection refused" in message
    with pytest.raises(EtcdError, match="connection refused"):
        list_nodes(dead, "c", timeout_s=0.5)
    reg = NodeRegistration(dead, "c", node(1))
    with pytest.raises(EtcdError, match="unreachable"):
        reg.start()
    reg.close()
    with pytest.raises(ValueError, match="only http"):
        EtcdClient(["https://127.0.0.1:2379"])
    with pytest.raises(ValueError, match="no endpoints"):
        EtcdClient([])


@pytest.fixture
def not_etcd() -> Iterator[str]:
    """An HTTP server that is not etcd (answers 404 to everything)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_http_server_that_is_not_etcd_is_reported(not_etcd: str) -> None:
    with pytest.raises(EtcdError) as info:
        list_nodes([not_etcd], "c", timeout_s=1)
    assert not_etcd in str(info.value) and "not an etcd v3 JSON gateway" in str(info.value)


# -- the client on the session's etcd --------------------------------------------------------


def test_client_kv_lease_and_watch(etcd_endpoint: str, cluster_name: str) -> None:
    client = EtcdClient([f"http://127.0.0.1:{free_port()}", etcd_endpoint], timeout_s=1)
    prefix = f"/test/{cluster_name}/"
    assert client.get(prefix + "a") is None
    rev = client.put(prefix + "a", b"1")
    kvs, read_rev = client.get_prefix(prefix)
    assert [(kv.key, kv.value) for kv in kvs] == [(prefix.encode() + b"a", b"1")]
    assert read_rev >= rev
    with client.watch_prefix(prefix, read_rev + 1) as stream:
        first = stream.next(2)
        assert first is not None and first.created
        lease, ttl = client.lease_grant(5)
        assert ttl >= 5
        client.put(prefix + "b", b"2", lease=lease)
        assert client.lease_keepalive(lease) > 0
        assert client.lease_revoke(lease)
        assert not client.lease_revoke(lease)
        assert client.lease_keepalive(lease) == 0
        seen: list[tuple[str, bytes]] = []
        deadline = time.monotonic() + 5
        while len(seen) < 2 and time.monotonic() < deadline:
            msg = stream.next(0.5)
            if msg is not None:
                seen += [(e.type, e.kv.key) for e in msg.events]
        assert seen == [("PUT", prefix.encode() + b"b"), ("DELETE", prefix.encode() + b"b")]
    assert client.delete_prefix(prefix) == 1


# -- membership on the session's etcd --------------------------------------------------------


def test_registered_node_is_visible(etcd_endpoint: str, cluster_name: str) -> None:
    changes: list[list[str]] = []
    with EtcdMembership([etcd_endpoint], cluster_name,
                        on_change=lambda nodes: changes.append(ids(nodes))) as members:
        assert members.live_nodes() == []
        with NodeRegistration([etcd_endpoint], cluster_name, node(1)) as reg:
            assert reg.lease_id is not None
            assert list_nodes([etcd_endpoint], cluster_name) == [reg.node]  # with its run
            assert reg.node.incarnation and reg.node.identity
            wait_for(lambda: members.live_nodes() == [reg.node], 5, "watcher sees node-1")
            reg2 = NodeRegistration([etcd_endpoint], cluster_name, node(2)).start()
            wait_for(lambda: ids(members.live_nodes()) == ["node-1", "node-2"], 5,
                     "watcher sees node-2")
            reg2.close()
            wait_for(lambda: ids(members.live_nodes()) == ["node-1"], 5, "node-2 leaves")
        wait_for(lambda: members.live_nodes() == [], 5, "node-1 leaves")
    assert changes == [["node-1"], ["node-1", "node-2"], ["node-1"], []]


def test_nodes_joining_and_leaving_are_logged_as_events(
        etcd_endpoint: str, cluster_name: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvpool.cluster")

    def events() -> list[tuple[str, str]]:
        return [(r.event, r.node) for r in caplog.records
                if getattr(r, "event", None) in ("node_joined", "node_left")]

    with NodeRegistration([etcd_endpoint], cluster_name, node(1)), \
            EtcdMembership([etcd_endpoint], cluster_name) as members:
        assert events() == [("node_joined", "node-1")]  # the initial read
        with NodeRegistration([etcd_endpoint], cluster_name, node(2)):
            wait_for(lambda: len(members.live_nodes()) == 2, 5, "watcher sees node-2")
        wait_for(lambda: len(members.live_nodes()) == 1, 5, "node-2 leaves")
    assert events() == [("node_joined", "node-1"), ("node_joined", "node-2"),
                        ("node_left", "node-2")]
    joined = next(r for r in caplog.records if getattr(r, "event", None) == "node_joined")
    assert joined.cluster == cluster_name
    assert joined.address == "127.0.0.1:7001"
    assert "node node-1 (127.0.0.1:7001) joined" in joined.getMessage()


def test_a_new_watcher_sees_existing_nodes(etcd_endpoint: str, cluster_name: str) -> None:
    with NodeRegistration([etcd_endpoint], cluster_name, node(3)) as reg, \
            EtcdMembership([etcd_endpoint], cluster_name) as members:
        assert members.live_nodes() == [reg.node]


def test_drained_keys_are_seen_by_watchers_old_and_new(
        etcd_endpoint: str, cluster_name: str, caplog: pytest.LogCaptureFixture) -> None:
    """`kvpool admin drain` puts /kvpool/<cluster>/drained/<id>: a running watcher sees it come
    and go (logging node_drained / node_undrained once each), a new one reads it, and it never
    reads as a node (nor fires on_change)."""
    caplog.set_level(logging.INFO, logger="kvpool.cluster")
    etcd = EtcdClient([etcd_endpoint])
    changes: list[list[str]] = []
    with NodeRegistration([etcd_endpoint], cluster_name, node(1)), \
            EtcdMembership([etcd_endpoint], cluster_name,
                           on_change=lambda nodes: changes.append(ids(nodes))) as members:
        assert members.drained_nodes() == frozenset()
        etcd.put(drained_key(cluster_name, "node-1"), b"{}")
        wait_for(lambda: members.drained_nodes() == {"node-1"}, 5, "watcher sees the drain")
        etcd.put(drained_key(cluster_name, "node-9"), b"")  # a node not registered (yet)
        wait_for(lambda: members.drained_nodes() == {"node-1", "node-9"}, 5, "second drain")
        with EtcdMembership([etcd_endpoint], cluster_name) as fresh:
            assert fresh.drained_nodes() == {"node-1", "node-9"}
            assert ids(fresh.live_nodes()) == ["node-1"]
        etcd.delete(drained_key(cluster_name, "node-1"))
        wait_for(lambda: members.drained_nodes() == {"node-9"}, 5, "watcher sees the undrain")
        assert ids(members.live_nodes()) == ["node-1"] and changes == []
    drains = [(r.event, r.node) for r in caplog.records
              if getattr(r, "event", None) in ("node_drained", "node_undrained")]
    # once each by the running watcher; the fresh one's initial read names both drains too
    assert drains == [("node_drained", "node-1"), ("node_drained", "node-9"),
                      ("node_drained", "node-1"), ("node_drained", "node-9"),
                      ("node_undrained", "node-1")]
    assert StaticMembership(["10.0.0.1:7000"]).drained_nodes() == frozenset()
    etcd.delete(drained_key(cluster_name, "node-9"))


def test_clusters_are_isolated(etcd_endpoint: str, cluster_name: str) -> None:
    other = cluster_name + "x"  # a name that extends the first: prefixes must not overlap
    with EtcdMembership([etcd_endpoint], cluster_name) as mine, \
            EtcdMembership([etcd_endpoint], other) as theirs, \
            NodeRegistration([etcd_endpoint], cluster_name, node(1)), \
            NodeRegistration([etcd_endpoint], other, node(2)):
        wait_for(lambda: ids(mine.live_nodes()) == ["node-1"], 5, "own node visible")
        wait_for(lambda: ids(theirs.live_nodes()) == ["node-2"], 5, "other cluster's node")
        assert ids(list_nodes([etcd_endpoint], cluster_name)) == ["node-1"]
        assert ids(list_nodes([etcd_endpoint], other)) == ["node-2"]


def test_close_removes_the_node_at_once_and_is_idempotent(etcd_endpoint: str,
                                                          cluster_name: str) -> None:
    reg = NodeRegistration([etcd_endpoint], cluster_name, node(1), ttl_s=30).start()
    assert ids(list_nodes([etcd_endpoint], cluster_name)) == ["node-1"]
    reg.close()
    assert list_nodes([etcd_endpoint], cluster_name) == []  # no waiting for the 30 s TTL
    reg.close()
    assert reg.lease_id is None
    with pytest.raises(RuntimeError):
        reg.start()


def test_killed_registrant_is_dropped_after_its_ttl(etcd_endpoint: str,
                                                    cluster_name: str) -> None:
    with EtcdMembership([etcd_endpoint], cluster_name) as members:
        proc = subprocess.Popen(
            [sys.executable, str(REGISTRANT), etcd_endpoint, cluster_name, "node-9", "7009",
             "2"], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "registered"
            wait_for(lambda: ids(members.live_nodes()) == ["node-9"], 5, "registrant visible")
            time.sleep(1.0)  # outlive a keepalive or two: the lease is being refreshed
            assert ids(members.live_nodes()) == ["node-9"]
            proc.kill()
            proc.wait()
            # ttl 2 s (etcd checks expiry every 0.5 s); the deadline is generous.
            wait_for(lambda: members.live_nodes() == [], 15, "killed node dropped after TTL")
        finally:
            proc.kill()
            proc.wait()


def test_registrant_sigterm_deregisters(etcd_endpoint: str, cluster_name: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(REGISTRANT), etcd_endpoint, cluster_name, "node-8", "7008", "30"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "registered"
        assert ids(list_nodes([etcd_endpoint], cluster_name)) == ["node-8"]
        proc.terminate()
        assert proc.wait(10) == 0
        assert list_nodes([etcd_endpoint], cluster_name) == []
    finally:
        proc.kill()
        proc.wait()


def test_lost_lease_is_granted_again(etcd_endpoint: str, cluster_name: str) -> None:
    client = EtcdClient([etcd_endpoint])
    with EtcdMembership([etcd_endpoint], cluster_name) as members, \
            NodeRegistration([etcd_endpoint], cluster_name, node(1), ttl_s=1.5) as reg:
        first = reg.lease_id
        assert first is not None
        wait_for(lambda: ids(members.live_nodes()) == ["node-1"], 5, "node visible")
        assert client.lease_revoke(first)  # as if it had expired
        wait_for(lambda: reg.lease_id not in (None, first), 10, "a new lease")
        wait_for(lambda: ids(members.live_nodes()) == ["node-1"], 10, "node back")
        assert ids(list_nodes([etcd_endpoint], cluster_name)) == ["node-1"]


def test_malformed_values_are_skipped(etcd_endpoint: str, cluster_name: str) -> None:
    client = EtcdClient([etcd_endpoint])
    prefix = nodes_prefix(cluster_name)
    client.put(prefix + "junk", b"not json")
    client.put(prefix + "liar", node(5).to_json())  # key and record disagree
    try:
        with EtcdMembership([etcd_endpoint], cluster_name) as members:
            assert members.live_nodes() == []
            client.put(prefix + "node-1", node(1).to_json())
            client.put(prefix + "node-2", b"{}")
            wait_for(lambda: ids(members.live_nodes()) == ["node-1"], 5, "valid node seen")
            client.put(prefix + "node-1", b"broken")  # an update that breaks it removes it
            wait_for(lambda: members.live_nodes() == [], 5, "broken node dropped")
        assert list_nodes([etcd_endpoint], cluster_name) == []
    finally:
        client.delete_prefix(prefix)


def test_failing_on_change_does_not_stop_the_watch(etcd_endpoint: str,
                                                   cluster_name: str) -> None:
    def boom(nodes: list[NodeInfo]) -> None:
        raise RuntimeError("callback bug")

    with EtcdMembership([etcd_endpoint], cluster_name, on_change=boom) as members:
        with NodeRegistration([etcd_endpoint], cluster_name, node(1)):
            wait_for(lambda: ids(members.live_nodes()) == ["node-1"], 5, "node-1 seen")
        wait_for(lambda: members.live_nodes() == [], 5, "node-1 gone")


# -- etcd outages (a private etcd per test) --------------------------------------------------


def outage_warnings(caplog: pytest.LogCaptureFixture, what: str) -> int:
    return sum(1 for r in caplog.records
               if r.levelno == logging.WARNING and r.getMessage().startswith(f"kvpool {what} ")
               and "unreachable" in r.getMessage())


def test_etcd_down_keeps_last_set_then_restart_resyncs(
        etcd_server: EtcdServer, cluster_name: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvpool.cluster")
    ep = [etcd_server.endpoint]
    changes: list[list[str]] = []
    members = EtcdMembership(ep, cluster_name, on_change=lambda n: changes.append(ids(n)),
                             timeout_s=0.5)
    reg1 = NodeRegistration(ep, cluster_name, node(1), ttl_s=2, timeout_s=0.5).start()
    try:
        wait_for(lambda: ids(members.live_nodes()) == ["node-1"], 5, "node-1 seen")

        # etcd crashes: the last set stays, nothing raises, one warning for the outage.
        etcd_server.kill()
        wait_for(lambda: outage_warnings(caplog, "membership") >= 1, 10, "outage warning")
        for _ in range(20):
            assert ids(members.live_nodes()) == ["node-1"]
            time.sleep(0.05)
        with pytest.raises(EtcdError):
            list_nodes(ep, cluster_name, timeout_s=0.5)

        # Back with its data: registration and watch carry on; a change made now is seen.
        etcd_server.start()
        with NodeRegistration(ep, cluster_name, node(2), ttl_s=2):
            wait_for(lambda: ids(members.live_nodes()) == ["node-1", "node-2"], 15,
                     "watch resynced after restart")
        wait_for(lambda: ids(members.live_nodes()) == ["node-1"], 5, "node-2 left")
        assert outage_warnings(caplog, "membership") == 1

        # Back without its data (lease and key lost): node-1 registers again by itself.
        etcd_server.kill()
        etcd_server.wipe()
        etcd_server.start()
        wait_for(lambda: ids(list_nodes(ep, cluster_name)) == ["node-1"], 15,
                 "node-1 re-registered in the empty etcd")
        wait_for(lambda: ids(members.live_nodes()) == ["node-1"], 10, "watcher agrees")
        assert changes[:2] == [["node-1"], ["node-1", "node-2"]]
    finally:
        reg1.close()
        members.close()
    assert not members._thread.is_alive()
    assert reg1._thread is not None and not reg1._thread.is_alive()


def test_watcher_started_then_etcd_down_for_long(etcd_server: EtcdServer,
                                                 cluster_name: str) -> None:
    """Changes made while the watcher was cut off are seen: it re-reads, not just re-watches."""
    ep = [etcd_server.endpoint]
    with EtcdMembership(ep, cluster_name, timeout_s=0.5) as members:
        reg = NodeRegistration(ep, cluster_name, node(1), ttl_s=30).start()
        wait_for(lambda: ids(members.live_nodes()) == ["node-1"], 5, "node-1 seen")
        etcd_server.stop()
        assert ids(members.live_nodes()) == ["node-1"]
        reg.close()  # cannot revoke: logs, does not raise
        etcd_server.wipe()  # comes back empty, at revision 1: no event will say node-1 left
        etcd_server.start()
        wait_for(lambda: members.live_nodes() == [], 15, "stale node dropped after resync")


# -- grace period and records of older nodes (issue 22) -------------------------------------


def test_records_without_incarnation_or_identity_still_parse() -> None:
    old = NodeInfo.from_json(b'{"node_id": "n", "host": "h", "port": 1}')
    assert old == NodeInfo("n", "h", 1) and old.incarnation is None and not old.stopping
    full = NodeInfo("n", "h", 1, 2, incarnation="i", identity="d", stopping=True)
    assert NodeInfo.from_json(full.to_json()) == full


def test_a_vanished_key_stays_for_the_grace_period_a_clean_leave_goes_at_once(
        etcd_endpoint: str, cluster_name: str) -> None:
    with EtcdMembership([etcd_endpoint], cluster_name, grace_s=2.0) as members:
        with NodeRegistration([etcd_endpoint], cluster_name, node(1), ttl_s=30):
            wait_for(lambda: ids(members.live_nodes()) == ["node-1"], 5, "node-1 seen")
        wait_for(lambda: members.live_nodes() == [], 5, "a clean leave: gone at once")
        assert members.expected_nodes() == {"node-1"}

        reg = NodeRegistration([etcd_endpoint], cluster_name, node(2), ttl_s=30).start()
        wait_for(lambda: ids(members.live_nodes()) == ["node-2"], 5, "node-2 seen")
        client = EtcdClient([etcd_endpoint])
        lease = reg.lease_id
        reg._stop.set()  # its keepalive stops, as if the process had died
        assert lease is not None and client.lease_revoke(lease)  # the key goes, no "stopping"
        gone_at = time.monotonic()
        assert list_nodes([etcd_endpoint], cluster_name) == []
        time.sleep(0.5)
        assert ids(members.live_nodes()) == ["node-2"]  # kept for the grace period
        wait_for(lambda: members.live_nodes() == [], 10, "node-2 dropped after the grace")
        assert time.monotonic() - gone_at >= 1.5
        reg.close()
