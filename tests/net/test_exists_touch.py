"""EXISTS (one answer per key) and TOUCH (count a read without moving bytes) against real
nodes, the pool-side effect of a touch on DRAM and SSD eviction, and a node of the previous
release (started from the sources of OLD_COMMIT) that knows neither op."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from kvtest import byte_namespace, payload_for, small_config
from node_process import NodeProcess

from kvpool.config import ClusterConfig
from kvpool.keys import Namespace
from kvpool.net.client import ClusterClient
from kvpool.net.connection import NodeConnection
from kvpool.net.protocol import FEATURES, Feature, Op, RemoteError
from kvpool.net.touch import ReplicaToucher
from kvpool.pool import KVPool

CHUNK = 64 * 1024
#: The last commit before EXISTS and TOUCH: its node closes the connection on either op.
OLD_COMMIT = "177a4aa9492b8b19592f20524a330f0c3c5d5bf0"
REPO = Path(__file__).resolve().parents[2]


def test_exists_answers_every_key_and_touch_counts_the_held_ones(node: NodeProcess) -> None:
    ns = byte_namespace(CHUNK, salt="exists")
    keys = [os.urandom(16) for _ in range(8)]
    conn = NodeConnection(node.address)
    assert conn.put(ns, keys[::2], [payload_for(k, CHUNK) for k in keys[::2]]) == 4
    assert conn.features == FEATURES
    assert conn.exists(ns, keys) == [True, False] * 4
    assert conn.exists_prefix(ns, keys) == 1  # the old op still answers its leading run
    assert conn.exists(ns, []) == []
    assert conn.touch(ns, keys) == 4
    with pytest.raises(RemoteError, match="UNKNOWN_NAMESPACE"):
        conn.call(Op.TOUCH, 1, byte_namespace(CHUNK, salt="never declared").id + keys[0])
    with pytest.raises(RemoteError, match="UNKNOWN_NAMESPACE"):
        conn.call(Op.EXISTS, 1, byte_namespace(CHUNK, salt="never declared").id + keys[0])
    assert conn.exists(ns, keys[:2]) == [True, False]  # the connection is still usable
    # A GET may carry touch keys after the ones it fetches: answered for the fetched only.
    outs = [np.zeros(CHUNK, np.uint8) for _ in range(2)]
    assert conn.get_into(ns, keys[:2], outs, touch=keys[2:]) == [True, False]
    assert np.array_equal(outs[0], payload_for(keys[0], CHUNK))
    conn.close()


def chunk_in_dram(pool: KVPool, ns: Namespace, key: bytes) -> bool:
    view = pool.pin_many(ns, [key])[0]
    if view is None:
        return False
    view.release()
    return True


def test_a_touched_chunk_outlives_untouched_ones_in_dram(tmp_path: Path) -> None:
    """16 DRAM slots, S3-FIFO: chunks written once and never read leave first; a touch
    counts as a read, so touched chunks stay while 40 new ones pass through."""
    pool = KVPool(small_config(tmp_path, ssd={"enabled": False}))
    ns = byte_namespace(CHUNK)
    pool.register_namespace(ns)
    touched = [os.urandom(16) for _ in range(4)]
    untouched = [os.urandom(16) for _ in range(4)]
    for key in touched + untouched:
        assert pool.put(ns, key, payload_for(key, CHUNK))
    assert pool.touch(ns, [*touched, os.urandom(16)]) == 4
    for _ in range(40):
        key = os.urandom(16)
        pool.put(ns, key, payload_for(key, CHUNK))
        pool.touch(ns, touched)  # the replica of a chunk that another node keeps serving
    assert [chunk_in_dram(pool, ns, k) for k in touched] == [True] * 4
    assert [chunk_in_dram(pool, ns, k) for k in untouched] == [False] * 4
    pool.close()


def test_a_touched_chunk_is_copied_forward_on_ssd(tmp_path: Path) -> None:
    """SSD only, 4 segments of 1 MiB, second_chance: 8 MiB of churn evicts every segment
    more than once; touched chunks are copied forward, untouched ones are gone."""
    pool = KVPool(small_config(tmp_path, dram={"capacity": 0}))
    ns = byte_namespace(CHUNK)
    pool.register_namespace(ns)
    touched = [os.urandom(16) for _ in range(2)]
    untouched = [os.urandom(16) for _ in range(2)]
    for key in touched + untouched:
        assert pool.put(ns, key, payload_for(key, CHUNK))
    for _ in range(8):
        assert pool.flush(10)
        assert pool.touch(ns, touched) == 2
        for _ in range(15):  # about one segment
            key = os.urandom(16)
            pool.put(ns, key, payload_for(key, CHUNK))
    assert pool.flush(10)
    assert pool.stats()["ssd"]["segments_evicted"] >= 4
    out = np.zeros(CHUNK, np.uint8)
    for key in touched:
        assert pool.get_into(ns, key, out) and np.array_equal(out, payload_for(key, CHUNK))
    assert [pool.get_into(ns, k, out) for k in untouched] == [False, False]
    pool.close()


@pytest.fixture
def old_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[NodeProcess]:
    """A real node of the previous release: OLD_COMMIT's sources, first on its PYTHONPATH."""
    try:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", OLD_COMMIT, "src"],
                                 capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"needs the repository's git history ({exc})")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tmp_path / "old", filter="data")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "old" / "src"))
    proc = NodeProcess(tmp_path / "old-node")
    proc.start()
    monkeypatch.undo()
    yield proc
    proc.stop()


def test_an_old_node_is_asked_exists_prefix_and_never_touch(old_node: NodeProcess,
                                                            node: NodeProcess) -> None:
    ns = byte_namespace(CHUNK, salt="mixed")
    keys = [os.urandom(16) for _ in range(6)]
    absent = os.urandom(16)
    conn = NodeConnection(old_node.address)
    assert conn.put(ns, keys, [payload_for(k, CHUNK) for k in keys]) == 6
    assert conn.features == Feature(0)  # really the old node
    # Its leading run counts; past the first absent key it is "unknown", i.e. not held.
    assert conn.exists(ns, [*keys[:2], absent, *keys[2:]]) == [True, True] + [False] * 5
    assert conn.touch(ns, keys) == 0
    outs = [np.zeros(CHUNK, np.uint8)]
    assert conn.get_into(ns, keys[:1], outs, touch=keys[1:]) == [True]  # touch keys not sent
    conn.ping()  # no new op was sent: the connection is alive
    conn.close()
    # A rolling upgrade: one old and one new node, two replicas each.
    client = ClusterClient(ClusterConfig(nodes=[old_node.address, node.address], replicas=2))
    client.register_namespace(ns)
    more = [os.urandom(16) for _ in range(20)]
    assert client.put_many([(k, ns, payload_for(k, CHUNK)) for k in more]) == 20
    assert client.exists_prefix(ns, more) == 20
    assert client.exists_prefix(ns, [*more[:5], absent, *more[5:]]) == 5
    outs = [np.zeros(CHUNK, np.uint8) for _ in more]
    assert client.get_many_into(ns, more, outs) == [True] * 20
    stats = client.stats()
    assert stats.get("node_failures", 0) == 0 and len(stats["live_nodes"]) == 2
    client.close()


@pytest.mark.parametrize("batch_keys", [4096, 1])
def test_touch_batch_keys_sizes_the_touches_that_do_not_ride_in_a_get(
        tmp_path: Path, batch_keys: int) -> None:
    """Two replicas: a read touches the replica it did not fetch from. The first
    cluster.touch_batch_keys of a node's touch keys ride in its GET; the rest go out as
    TOUCHes of that many keys (one key each here), off the read path."""
    nodes = [NodeProcess(tmp_path / f"n{i}").start() for i in range(2)]
    try:
        client = ClusterClient(ClusterConfig(nodes=[n.address for n in nodes], replicas=2,
                                             touch_batch_keys=batch_keys))
        ns = byte_namespace(CHUNK, salt="touch-batch")
        client.register_namespace(ns)
        keys = [os.urandom(16) for _ in range(20)]
        assert client.put_many([(k, ns, payload_for(k, CHUNK)) for k in keys]) == 20
        outs = [np.zeros(CHUNK, np.uint8) for _ in keys]
        assert client.get_many_into(ns, keys, outs) == [True] * 20
        deadline = time.monotonic() + 10
        while client._toucher.pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = client.stats()
        if batch_keys == 1:  # at most one key per node rides; every other one is a TOUCH
            assert stats["touched_keys"] >= 18
            assert stats["touch_requests"] == stats["touched_keys"]
        else:
            assert stats.get("touched_keys", 0) == 0  # all rode in the GETs
        client.close()
    finally:
        for n in nodes:
            n.stop()


def test_touch_queue_bound_and_threads_from_the_config() -> None:
    """cluster.touch_max_keys bounds a node's queue (the rest dropped, counted),
    cluster.touch_batch_keys sizes each TOUCH, cluster.touch_threads bounds the senders."""
    cfg = ClusterConfig(touch_threads=1, touch_max_keys=3, touch_batch_keys=2)
    sent: list[list[bytes]] = []
    toucher = ReplicaToucher(lambda node_id, ns, keys: sent.append(keys) is None,
                             cfg.touch_threads, cfg.touch_max_keys, cfg.touch_batch_keys)
    keys = [bytes([i]) * 16 for i in range(5)]
    toucher.add(byte_namespace(CHUNK), {"a": keys})
    deadline = time.monotonic() + 10
    while toucher.pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    toucher.close()
    assert sent == [keys[:2], keys[2:3]]
    assert toucher.counters == {"touch_requests": 2, "touched_keys": 3, "touch_dropped": 2}


def test_probes_see_dram_and_ssd(tmp_path: Path) -> None:
    """EXISTS and EXISTS_PREFIX see chunks in DRAM and on the SSD only. The node's config
    still carries a key of the former transport (server.inline_exists_keys): accepted and
    ignored."""
    node = NodeProcess(tmp_path / "node", server={"inline_exists_keys": 4}).start()
    try:
        ns = byte_namespace(CHUNK, salt="inline")
        keys = [os.urandom(16) for _ in range(10)]
        conn = NodeConnection(node.address)
        assert conn.put(ns, keys[:4], [payload_for(k, CHUNK) for k in keys[:4]]) == 4
        conn.close()
        node.terminate()  # written through: after the restart keys[:4] are on the SSD only
        node.start()
        conn = NodeConnection(node.address)
        assert conn.put(ns, keys[6:8], [payload_for(k, CHUNK) for k in keys[6:8]]) == 2
        held = [True] * 4 + [False] * 2 + [True] * 2 + [False] * 2
        for batch in (slice(0, 3), slice(3, 7), slice(0, 10)):
            assert conn.exists(ns, keys[batch]) == held[batch]
            assert conn.exists_prefix(ns, keys[batch]) == (held[batch] + [False]).index(False)
        conn.close()
    finally:
        node.stop()
