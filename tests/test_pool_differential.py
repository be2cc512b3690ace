"""Differential test of KVPool's tier stack: hypothesis drives a real KVPool (real DRAM arena,
real SSD engine in a temp dir, real write-behind threads) and a reference store (a dict of
(namespace, key)) with the same operations, and every answer must agree.

The geometry is chosen so that the pool has no excuse to differ: DRAM holds a fraction of the
chunks (evictions and demotions happen all the time, reads come from every tier), the SSD and
the staging queues hold everything (nothing may be dropped). Pool configurations: DRAM evicting
to SSD; write-through (cache and durable); SSD only; DRAM only. Through-mode pools are also
closed and reopened on the same directory mid-run: what they acknowledged must come back.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvtest import byte_namespace, payload_for

from kvpool import KVPool
from kvpool.config import config_from_dict
from kvpool.keys import Namespace
from kvpool.pool import ChunkReservation

BIG, SMALL = 16 << 10, 8 << 10
NAMESPACES = [byte_namespace(BIG, model="big"), byte_namespace(SMALL, model="small")]
# Two prompt families per namespace sharing a 4-chunk prefix: lookups see shared and forked runs.
FAMILIES = [list(range(20)), [0, 1, 2, 3, *range(100, 116)]]
KEYS = {ns.id: [ns.chunk_keys(tokens) for tokens in FAMILIES] for ns in NAMESPACES}

CONFIGS: dict[str, dict[str, Any]] = {
    "evict": {},
    "through": {"pool": {"ssd_write": "through"}},
    "durable": {"pool": {"ssd_write": "through"}, "ssd": {"durability": "durable"}},
    "ssd_only": {"dram": {"capacity": 0}},
    "dram_only": {"dram": {"capacity": "2MiB"}, "ssd": {"enabled": False}},
}
REOPENS = {"through", "durable", "ssd_only"}
MAX_REOPENS = 4  # each reopen seals the active segment: more would fill the log


def make_config(directory: Path, name: str) -> Any:
    data: dict[str, Any] = {
        "cache_dir": str(directory),
        # 256 KiB: 16 big or 32 small chunks, far fewer than the 72 keys
        "dram": {"capacity": "256KiB", "slab_size": "128KiB", "eviction": "s3fifo"},
        # 32 segments: the writes and the segment each reopen seals fit without an eviction
        "ssd": {"capacity": "32MiB", "segment_size": "1MiB"},
        "pool": {"write_behind_bytes": "8MiB"},
    }
    for section, values in CONFIGS[name].items():
        data[section] = {**data[section], **values}
    return config_from_dict(data)


ns_index = st.integers(0, len(NAMESPACES) - 1)
family = st.integers(0, len(FAMILIES) - 1)
position = st.integers(0, len(FAMILIES[0]) - 1)


class PoolAgainstReference(RuleBasedStateMachine):
    config_name = "evict"

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvpool-diff-"))
        self.pool = self._open()
        self.reopens = 0
        self.held: set[tuple[bytes, bytes]] = set()  # the reference: (namespace id, key)

    def _open(self) -> KVPool:
        pool = KVPool(make_config(self.dir, self.config_name), remote=False)
        for ns in NAMESPACES:
            pool.register_namespace(ns)
        return pool

    def teardown(self) -> None:
        self.pool.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @staticmethod
    def _pick(n: int, f: int, p: int) -> tuple[Namespace, bytes]:
        ns = NAMESPACES[n]
        return ns, KEYS[ns.id][f][p]

    # ------------------------------------------------------------------ writes
    @rule(n=ns_index, f=family, start=position, count=st.integers(1, 12))
    def put_run(self, n: int, f: int, start: int, count: int) -> None:
        ns = NAMESPACES[n]
        keys = KEYS[ns.id][f][start:start + count]
        stored = self.pool.put_many(ns, keys, [payload_for(k, ns.chunk_bytes) for k in keys])
        assert stored == len(keys)  # nothing may be dropped with this much room
        self.held.update((ns.id, k) for k in keys)

    @rule(n=ns_index, f=family, p=position, commit=st.booleans())
    def reserve_fill(self, n: int, f: int, p: int, commit: bool) -> None:
        ns, key = self._pick(n, f, p)
        slot = self.pool.reserve(ns, key)
        if slot is True:
            assert (ns.id, key) in self.held
            return
        assert isinstance(slot, ChunkReservation), slot
        slot.view[:] = memoryview(payload_for(key, ns.chunk_bytes))
        if commit:
            assert slot.commit()
            self.held.add((ns.id, key))
        else:
            slot.abort()

    @rule(n=ns_index, f=family, p=position)
    def delete(self, n: int, f: int, p: int) -> None:
        ns, key = self._pick(n, f, p)
        assert self.pool.delete(ns, key) == ((ns.id, key) in self.held)
        self.held.discard((ns.id, key))

    @precondition(lambda self: len(self.held) > 24)  # rarely: it empties the pool
    @rule(n=ns_index)
    def invalidate(self, n: int) -> None:
        ns = NAMESPACES[n]
        had = any(ns_id == ns.id for ns_id, _ in self.held)
        dropped = self.pool.invalidate(ns)
        if not had:
            assert dropped == 0
        self.held = {(ns_id, k) for ns_id, k in self.held if ns_id != ns.id}

    @rule()
    def flush(self) -> None:
        assert self.pool.flush(10)

    @precondition(lambda self: self.config_name in REOPENS and self.reopens < MAX_REOPENS)
    @rule()
    def reopen(self) -> None:
        assert self.pool.flush(10)
        self.pool.close()
        self.pool = self._open()
        self.reopens += 1

    # ------------------------------------------------------------------ reads
    @rule(n=ns_index, f=family, start=position, count=st.integers(1, 8))
    def get_run(self, n: int, f: int, start: int, count: int) -> None:
        ns = NAMESPACES[n]
        keys = KEYS[ns.id][f][start:start + count]
        outs = [np.zeros(ns.chunk_bytes, np.uint8) for _ in keys]
        found = self.pool.get_many_into(ns, keys, outs)
        assert found == [(ns.id, k) in self.held for k in keys]
        for key, out, hit in zip(keys, outs, found, strict=True):
            if hit:
                assert np.array_equal(out, payload_for(key, ns.chunk_bytes))

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def get_held(self, data: st.DataObject) -> None:
        """Read chunks the reference holds, wherever the pool keeps them now."""
        picks = data.draw(st.lists(st.sampled_from(sorted(self.held)), min_size=1, max_size=8,
                                   unique=True))
        for ns in NAMESPACES:
            keys = [k for ns_id, k in picks if ns_id == ns.id]
            outs = [np.zeros(ns.chunk_bytes, np.uint8) for _ in keys]
            assert self.pool.get_many_into(ns, keys, outs) == [True] * len(keys)
            for key, out in zip(keys, outs, strict=True):
                assert np.array_equal(out, payload_for(key, ns.chunk_bytes))

    @rule(n=ns_index, f=family, p=position)
    def pin(self, n: int, f: int, p: int) -> None:
        ns, key = self._pick(n, f, p)
        view = self.pool.pin_many(ns, [key])[0]
        if view is None:
            return  # not in DRAM: allowed for a cache tier
        with view:
            assert (ns.id, key) in self.held
            assert np.array_equal(np.frombuffer(view.data, np.uint8),
                                  payload_for(key, ns.chunk_bytes))

    @rule(n=ns_index, f=family)
    def lookup(self, n: int, f: int) -> None:
        ns = NAMESPACES[n]
        keys = KEYS[ns.id][f]
        expected = next((i for i, k in enumerate(keys) if (ns.id, k) not in self.held),
                        len(keys))
        assert self.pool.lookup(ns, keys) == expected

    @rule(n=ns_index, f=family)
    def contains_and_touch(self, n: int, f: int) -> None:
        ns = NAMESPACES[n]
        keys = KEYS[ns.id][f]
        expected = [(ns.id, k) in self.held for k in keys]
        assert self.pool.contains_many(ns, keys) == expected
        # touch counts what DRAM or the SSD index holds; staged-only chunks are not touched
        assert self.pool.touch(ns, keys) <= sum(expected)

    @invariant()
    def nothing_dropped(self) -> None:
        """The geometry leaves the pool no excuse: a drop or an SSD eviction voids the
        comparison, so it fails here, named, rather than as a confusing mismatch."""
        stats = self.pool.stats()
        assert stats.get("write_behind", {}).get("dropped", 0) == 0
        assert stats.get("dram", {}).get("dropped_puts", 0) == 0
        assert stats.get("ssd", {}).get("segments_evicted", 0) == 0


def _machine(name: str) -> type[PoolAgainstReference]:
    return type(f"Pool_{name}", (PoolAgainstReference,), {"config_name": name})


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_pool_agrees_with_the_reference_store(name: str) -> None:
    machine = _machine(name)
    machine.TestCase.settings = settings(max_examples=30, stateful_step_count=50,
                                         deadline=None,
                                         suppress_health_check=list(HealthCheck))
    machine.TestCase().runTest()
