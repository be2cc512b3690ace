"""``ssd.durability: durable`` + ``pool.ssd_write: through`` at the KVPool level: what ``put``
acknowledges survives a SIGKILL at any moment (DRAM tier on and off), and a batch put is
synced as one. Real child processes, killed at random moments (during start-up and recovery
too), real files."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from kvtest import load_script, payload_for, read_acks, run_and_kill

from kvpool import KVPool

HERE = Path(__file__).resolve().parent
WRITER = HERE / "durable_pool_writer.py"
CYCLES = 50


dw = load_script(WRITER)


def _run_and_kill(cache_dir: Path, ack: Path, *, dram: bool, start: int, salt: str,
                  rng: random.Random, log: Path) -> None:
    """Start a writer and SIGKILL it: mostly while it writes, sometimes before it is ready
    (during imports, the lock, recovery)."""
    args = [str(WRITER), str(cache_dir), "1" if dram else "0", str(start), str(ack), salt]
    if rng.random() < 0.2:
        run_and_kill(args, log, rng.uniform(0.05, 0.8), wait_ready=False)
    else:
        run_and_kill(args, log, rng.uniform(0.0, 0.5))


def _lost(pool: KVPool, keys: list[bytes]) -> list[bytes]:
    """Acknowledged keys that do not read back byte-exact."""
    lost: list[bytes] = []
    for lo in range(0, len(keys), 64):
        batch = keys[lo:lo + 64]
        outs = [np.zeros(dw.CHUNK, np.uint8) for _ in batch]
        for key, out, hit in zip(batch, outs, pool.get_many_into(dw.NS, batch, outs),
                                 strict=True):
            if not hit or not np.array_equal(out, payload_for(key, dw.CHUNK)):
                lost.append(key)
    return lost


@pytest.mark.slow
def test_sigkill_at_random_moments_loses_no_acknowledged_put(tmp_path: Path) -> None:
    """Each cycle checks the chunks acknowledged since the last one and a sample of older
    ones; the end checks all of them."""
    cache_dir, ack, log = tmp_path / "cache", tmp_path / "acks.log", tmp_path / "child.log"
    rng = random.Random(20261201)
    salt = "durable-pool"
    checked = 0
    for cycle in range(CYCLES):
        dram = cycle % 2 == 0
        _run_and_kill(cache_dir, ack, dram=dram, start=len(read_acks(ack)), salt=salt,
                      rng=rng, log=log)
        acked = read_acks(ack)
        sample = acked[checked:] + rng.sample(acked[:checked], min(checked, 256))
        checked = len(acked)
        with KVPool(dw.durable_config(str(cache_dir), dram=False)) as pool:
            pool.register_namespace(dw.NS)
            lost = _lost(pool, sample)
        assert not lost, (f"cycle {cycle} (dram={dram}): {len(lost)} of {len(sample)} "
                          "checked acknowledged chunks lost")
    acked = read_acks(ack)
    with KVPool(dw.durable_config(str(cache_dir), dram=False)) as pool:
        pool.register_namespace(dw.NS)
        lost = _lost(pool, acked)
    print(f"\n{CYCLES} SIGKILL cycles, {len(acked)} acknowledged, {len(lost)} lost")
    assert not lost
    assert len(acked) > CYCLES * 10  # the children really wrote between the kills


def test_durable_put_is_on_disk_when_it_returns(tmp_path: Path) -> None:
    """No write-behind between a durable put and the SSD: the record is indexed (written and
    synced) before put returns, a batch shares its syncs, nothing waits in staging."""
    cfg = dw.durable_config(str(tmp_path / "cache"), dram=True)
    with KVPool(cfg) as pool:
        assert pool.durable_puts
        pool.register_namespace(dw.NS)
        keys = [dw.key_of("now", i) for i in range(20)]
        assert pool.put(dw.NS, keys[0], payload_for(keys[0], dw.CHUNK))
        assert pool.put_many(dw.NS, keys[1:], [payload_for(k, dw.CHUNK) for k in keys[1:]]) == 19
        stats = pool.stats()
        assert stats["ssd"]["records"] == 20 and stats["ssd"]["puts"] == 20
        assert stats["write_behind"]["offered"] == 0  # nothing went through the queue
        # the same chunks again: idempotent, no second record
        assert pool.put_many(dw.NS, keys, [payload_for(k, dw.CHUNK) for k in keys]) == 20
        assert pool.stats()["ssd"]["puts"] == 20
        # a chunk filled in place (the storage node's PUT path) is durable at commit
        key = dw.key_of("now", 99)
        slot = pool.reserve(dw.NS, key)
        assert slot is not None and not isinstance(slot, bool)
        slot.view[:] = payload_for(key, dw.CHUNK)
        assert slot.commit()
        assert pool.stats()["ssd"]["records"] == 21
        # several at once (a node's PUT batch): all written and synced before it returns
        batch = [dw.key_of("batch", i) for i in range(4)]
        slots = [pool.reserve(dw.NS, k) for k in batch]
        for k, s in zip(batch, slots, strict=True):
            assert s is not None and not isinstance(s, bool)
            s.view[:] = payload_for(k, dw.CHUNK)
        assert pool.commit_many([s for s in slots if not isinstance(s, bool | None)]) == 4
        assert pool.stats()["ssd"]["records"] == 25
        out = np.zeros(dw.CHUNK, np.uint8)
        assert all(pool.get_into(dw.NS, k, out) and np.array_equal(out, payload_for(k, dw.CHUNK))
                   for k in batch)


def test_cache_mode_keeps_write_behind(tmp_path: Path) -> None:
    """Only durable + through bypasses the queue: cache mode still acknowledges from memory."""
    cfg = dw.durable_config(str(tmp_path / "cache"), dram=True)
    cfg.ssd.durability = "cache"
    with KVPool(cfg) as pool:
        assert not pool.durable_puts
        pool.register_namespace(dw.NS)
        key = dw.key_of("cache", 0)
        assert pool.put(dw.NS, key, payload_for(key, dw.CHUNK))
        pool.flush()
        assert pool.stats()["write_behind"]["offered"] == 1
