"""Prefix lookups (ClusterClient.exists_prefix) over three real nodes in a real etcd with
replicas=2 while nodes are paused, killed or added: every chunk that a live replica holds
counts, and the run stops exactly at the first chunk no live replica holds.

Each test prints "lookups short: S of T" (S = lookups that returned less than the readable
prefix); on main before per-key EXISTS, a paused or killed node made nearly every lookup
short."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from kvtest import byte_namespace, payload_for, wait_for
from node_faults import NodeSet, node_set, pause

from kvpool.net.client import ClusterClient
from kvpool.net.placement import replicas

CHUNK = 16 * 1024
NS = byte_namespace(CHUNK, salt="lookup-test")
STORED = 90
LOOKUPS = 40


@pytest.fixture
def nodes(tmp_path: Path, etcd_endpoint: str, cluster_name: str) -> Iterator[NodeSet]:
    with node_set(tmp_path, etcd_endpoint, cluster_name, 3) as ns:
        yield ns


def store(c: ClusterClient, keys: list[bytes]) -> None:
    assert c.put_many([(k, NS, payload_for(k, CHUNK)) for k in keys]) == len(keys)


def readable(c: ClusterClient, keys: list[bytes]) -> list[bool]:
    """Which chunks a GET finds now (and that they are the right bytes)."""
    outs = [np.zeros(CHUNK, np.uint8) for _ in keys]
    found = c.get_many_into(NS, keys, outs)
    for key, out, hit in zip(keys, outs, found, strict=True):
        assert not hit or np.array_equal(out, payload_for(key, CHUNK))
    return found


def leading(flags: list[bool]) -> int:
    n = 0
    while n < len(flags) and flags[n]:
        n += 1
    return n


def short_lookups(c: ClusterClient, keys: list[bytes], run: int, label: str) -> int:
    """LOOKUPS lookups of prefixes of ``keys`` (the full list first, then random lengths);
    ``run`` is the readable leading run of the full list. Prints and returns how many came
    back shorter than expected; a longer answer fails at once."""
    rng = random.Random(7)
    short = 0
    for t in range(LOOKUPS):
        length = len(keys) if t == 0 else rng.randint(1, len(keys))
        want = min(run, length)
        got = c.exists_prefix(NS, keys[:length])
        assert got <= want, f"lookup of {length} keys answered {got}, only {want} readable"
        short += got < want
    print(f"\n{label}: lookups short: {short} of {LOOKUPS}")
    return short


@pytest.mark.parametrize("fault", ["sigstop", "kill9"])
def test_one_node_down_every_chunk_with_a_live_replica_counts(nodes: NodeSet,
                                                              fault: str) -> None:
    c = nodes.client(NS)
    keys = [os.urandom(16) for _ in range(STORED)]
    store(c, keys)
    assert c.exists_prefix(NS, keys) == STORED
    victim = nodes.procs[1]
    if fault == "sigstop":
        pause(victim)
    else:
        victim.kill9()
    # Every chunk has two replicas, so one of them is live: a lookup must see all of it,
    # the very first one (which meets the fault and marks the node down) included.
    short = short_lookups(c, keys, STORED, f"one node {fault}")
    assert readable(c, keys) == [True] * STORED
    assert short == 0
    c.close()


def test_a_chunk_whose_replicas_are_all_down_ends_the_run_exactly_there(
        nodes: NodeSet) -> None:
    c = nodes.client(NS)
    # Ten chunks node-2 holds, then one only node-0 and node-1 hold, then a mix.
    pool = [os.urandom(16) for _ in range(400)]
    sets = replicas(nodes.ids(), pool, 2)
    with_2 = [k for k, r in zip(pool, sets, strict=True) if "node-2" in r]
    without_2 = [k for k, r in zip(pool, sets, strict=True) if "node-2" not in r]
    keys = with_2[:10] + without_2[:1] + with_2[10:30] + without_2[1:6]
    random.Random(3).shuffle(tail := keys[11:])
    keys[11:] = tail
    store(c, keys)
    pause(nodes.procs[0])
    nodes.procs[1].kill9()
    first = c.exists_prefix(NS, keys)  # meets both faults
    assert first == 10
    short = short_lookups(c, keys, 10, "two of three nodes down")
    assert readable(c, keys) == ["node-2" in r for r in replicas(nodes.ids(), keys, 2)]
    assert short == 0
    c.close()


def test_a_node_added_after_the_writes_shortens_no_lookup(nodes: NodeSet) -> None:
    c = nodes.client(NS)
    keys = [os.urandom(16) for _ in range(STORED)]
    store(c, keys)
    nodes.add()  # empty, and now a replica of about half the chunks
    wait_for(lambda: len(c.live_nodes()) == 4, 15, "the new node in placement")
    moved = sum("node-3" in r for r in replicas(nodes.ids(), keys, 2))
    assert moved > 10
    short = short_lookups(c, keys, STORED, "a node added after the writes")
    assert readable(c, keys) == [True] * STORED
    # Added, and an old node paused: each chunk's places moved again, but rendezvous
    # hashing keeps one live holder among them (the surviving old replica outranks the
    # third old node), so every chunk is still readable and counts.
    pause(nodes.procs[0])
    c.exists_prefix(NS, keys)  # marks node-0 down
    run = leading(readable(c, keys))
    assert run == STORED
    short += short_lookups(c, keys, run, "a node added, another paused")
    assert short == 0
    c.close()
