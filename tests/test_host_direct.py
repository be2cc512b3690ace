"""Direct reads (host.direct_reads): an attached engine reads DRAM hits through the host
pool's read directory without a round trip, the host pool still counts them, and no read
ever returns bytes of a slot that changed hands under it (real processes racing)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from host_child import CHURN_KEYS, chunks, namespace
from host_support import child, engine_config, host_config, start_host, write_config
from kvtest import payload_for, wait_for

from kvpool.config import config_from_dict
from kvpool.host import wire
from kvpool.host.client import AttachedPool
from kvpool.host.server import HostServer
from kvpool.keys import Namespace


def test_reads_skip_the_round_trip_and_the_host_pool_still_counts_them(tmp_path: Path) -> None:
    """A second engine reads what the first saved without asking (no request reaches the
    host pool for the read itself), the host pool then counts the reads as DRAM hits and in
    its eviction's recency (LRU: the chunks read survive the next saves, the others go),
    and a chunk the directory lacks is still read by asking."""
    data = host_config(tmp_path, dram={"eviction": "lru"})
    server = HostServer(config_from_dict(data)).start()
    writer = AttachedPool(engine_config(data))
    reader = AttachedPool(engine_config(data))
    try:
        ns = writer.register_namespace(namespace())
        reader.register_namespace(ns)
        keys, datas = chunks(ns, 1, 8)  # all 8 slots
        assert writer.put_many(ns, keys, datas) == 8
        link = reader._link()
        assert link is not None and link.directory is not None
        sent: list[str] = []
        original = wire.send_frame

        def counting(sock, meta, *args, **kwargs):  # type: ignore[no-untyped-def]
            sent.append(meta.get("op"))
            return original(sock, meta, *args, **kwargs)

        wire.send_frame = counting
        try:
            outs = [np.zeros_like(d) for d in datas[:4]]
            assert reader.get_many_into(ns, keys[:4], outs) == [True] * 4
        finally:
            wire.send_frame = original
        assert sent == []  # no request for the read
        assert all(np.array_equal(o, d) for o, d in zip(outs, datas, strict=False))
        attached = reader.stats()["attached"]  # the stats request carries the reads first
        assert attached["direct_hits"] == 4 and attached["dram_hits"] == 4
        stats = reader.stats()
        assert stats["dram"]["hits"] == 4 and stats["pool"]["dram_hits"] == 4
        newer, newer_datas = chunks(ns, 2, 4)
        assert writer.put_many(ns, newer, newer_datas) == 4  # evicts the 4 not read
        assert reader.contains_many(ns, keys) == [True] * 4 + [False] * 4
        absent = chunks(ns, 3, 1)[0]
        outs = [np.zeros_like(d) for d in datas[:2]]
        assert reader.get_many_into(ns, [keys[0], absent[0]], outs) == [True, False]
    finally:
        reader.close()
        writer.close()
        server.stop()


def test_an_engine_with_direct_reads_off_asks_for_every_read(tmp_path: Path) -> None:
    data = host_config(tmp_path)
    server = HostServer(config_from_dict(data)).start()
    fds_before = len(os.listdir("/proc/self/fd"))
    pool = AttachedPool(engine_config(data, direct_reads=False))
    try:
        ns = pool.register_namespace(namespace())
        keys, datas = chunks(ns, 1, 4)
        assert pool.put_many(ns, keys, datas) == 4
        link = pool._link()
        assert link is not None and link.directory is None  # the descriptor was closed
        outs = [np.zeros_like(d) for d in datas]
        assert pool.get_many_into(ns, keys, outs) == [True] * 4
        assert pool.stats()["attached"]["direct_hits"] == 0
    finally:
        pool.close()
        server.stop()
    wait_for(lambda: len(os.listdir("/proc/self/fd")) <= fds_before, 10, "descriptors closed")


def test_a_killed_host_pool_stops_direct_reads_and_its_successor_serves_them(
        tmp_path: Path) -> None:
    """The engine still maps the dead host pool's arena and directory; a read sees the
    socket closed (one poll), detaches and misses instead of reading the old mapping; the
    restarted host pool's chunks are read directly again after the re-attach."""
    data = host_config(tmp_path)
    host = start_host(tmp_path, data)
    pool = AttachedPool(engine_config(data))
    try:
        ns = pool.register_namespace(namespace())
        keys, datas = chunks(ns, 1, 4)
        assert pool.put_many(ns, keys, datas) == 4
        outs = [np.zeros_like(d) for d in datas]
        assert pool.get_many_into(ns, keys, outs) == [True] * 4
        host.kill()
        assert pool.get_many_into(ns, keys, outs) == [False] * 4
        assert not pool.attached
        host = start_host(tmp_path, data)
        wait_for(lambda: pool.put_many(ns, keys, datas) == 4, 20, "attached again")
        assert pool.get_many_into(ns, keys, outs) == [True] * 4
        assert all(np.array_equal(o, d) for o, d in zip(outs, datas, strict=True))
        assert pool.stats()["attached"]["direct_hits"] == 8
    finally:
        pool.close()
        host.stop()


def test_reads_racing_evictions_in_other_processes_never_return_another_chunks_bytes(
        tmp_path: Path) -> None:
    """One engine process saves 16 chunks, four at a time, through the host pool's 8 DRAM
    slots (every save evicts; slots change hands all the time); two others read all 16 in
    a loop through the directory and check each hit's bytes, which derive from its key. Every hit
    carries its own chunk's bytes; the readers hit, directly."""
    data = host_config(tmp_path, dram={"put_wait_s": 0.05})
    host = start_host(tmp_path, data)
    config = write_config(tmp_path, data, "engine.yaml")
    stop = tmp_path / "stop"
    try:
        seed = AttachedPool(config_from_dict(data))
        ns = seed.register_namespace(namespace())
        keys = chunks(ns, 77, CHURN_KEYS)[0]
        assert seed.put_many(ns, keys[:8], [payload_for(k, ns.chunk_bytes) for k in keys[:8]]) == 8
        seed.close()
        writer = child("churn", config, stop, 30)
        readers = [child("verify", config, stop, 30) for _ in range(2)]
        time.sleep(6)
        stop.touch()
        results = [proc.communicate(timeout=60)[0] for proc in [writer, *readers]]
        assert all(proc.returncode == 0 for proc in [writer, *readers]), results
        churn, *verified = [__import__("json").loads(out.strip().splitlines()[-1])
                            for out in results]
        assert churn["rounds"] > 20
        for result in verified:
            assert result["wrong"] == 0, result
            assert result["hits"] > 0 and result["direct_hits"] > 0, result
    finally:
        stop.touch()
        host.stop()


def test_a_flood_of_reported_reads_does_not_stall_another_engines_reads(tmp_path: Path) -> None:
    """An attached engine may report any keys as read: rounds of 64 READS frames of 65,536
    keys each (64 MiB), for a second or more, are counted a frame and a batch at a time,
    never holding the host pool's DRAM lock or its interpreter for the whole flood, so
    another engine's reads that need them (direct reads off: each pins) keep answering
    meanwhile; one frame past the limit (4M keys) is refused before its keys are split."""
    data = host_config(tmp_path, host={"max_frame_bytes": "128MiB"})
    host = start_host(tmp_path, data)
    flooder = AttachedPool(engine_config(data))
    reader = AttachedPool(engine_config(data, direct_reads=False))
    try:
        ns = reader.register_namespace(namespace())
        flooder.register_namespace(ns)
        keys, datas = chunks(ns, 1, 4)
        assert reader.put_many(ns, keys, datas) == 4
        link = flooder._link()
        assert link is not None
        frame = np.random.default_rng(0).integers(
            0, 256, wire.MAX_READS_KEYS * 16, np.uint8).tobytes()
        outs = [np.zeros_like(d) for d in datas]
        done: list[float] = []
        started = time.monotonic()

        def flood() -> None:  # the stats answer comes once every frame before it was counted
            link.send({"op": wire.READS, "ns": ns.id.hex(), "n": 61 * wire.MAX_READS_KEYS},
                      frame * 61)
            # Flood for at least a second however fast this machine counts, so that a read
            # stalled behind the whole flood stands out from one that waited for one batch.
            while time.monotonic() - started < 1.0 and len(done) < 40:
                for _ in range(64):
                    link.send({"op": wire.READS, "ns": ns.id.hex(),
                               "n": wire.MAX_READS_KEYS}, frame)
                flooder.stats()
                done.append(time.monotonic() - started)

        flooding = threading.Thread(target=flood)
        flooding.start()
        slowest = 0.0
        while flooding.is_alive():
            began = time.monotonic()
            assert reader.get_many_into(ns, keys, outs) == [True] * 4
            slowest = max(slowest, time.monotonic() - began)
        flooding.join()
        assert done, "the flooder's stats request was not answered"
        assert done[-1] > 0.5, "the flood was counted too fast to tell anything"
        assert slowest < done[-1] / 4, (slowest, done)
        assert flooder.attached and reader.attached
    finally:
        flooder.close()
        reader.close()
        host.stop()


@contextlib.contextmanager
def one_engine(tmp_path: Path, stored: int) -> Iterator[tuple[AttachedPool, Namespace,
                                                             list[bytes], list[np.ndarray]]]:
    """A host pool in this process and one attached engine that stored ``stored`` chunks:
    (pool, namespace, keys, bytes). Both are closed afterwards."""
    data = host_config(tmp_path)
    server = HostServer(config_from_dict(data)).start()
    pool = AttachedPool(engine_config(data))
    try:
        ns = pool.register_namespace(namespace())
        keys, datas = chunks(ns, 1, stored)
        assert pool.put_many(ns, keys, datas) == stored
        yield pool, ns, keys, datas
    finally:
        pool.close()
        server.stop()


def test_reads_frames_past_the_limit_are_refused_and_others_counted(tmp_path: Path) -> None:
    """READS frames are counted up to wire.MAX_READS_KEYS keys; a longer one is refused
    whole (nothing counted), and the connection stays up."""
    with one_engine(tmp_path, 4) as (pool, ns, keys, _):
        link = pool._link()
        assert link is not None

        def hits() -> int:
            return int(pool.stats()["dram"]["hits"])

        before = hits()
        limit = wire.MAX_READS_KEYS
        for n in (limit + 4, limit):  # the same four resident keys, over and over
            link.send({"op": wire.READS, "ns": ns.id.hex(), "n": n}, b"".join(keys) * (n // 4))
        assert hits() == before + limit
        assert pool.attached


def test_threads_of_one_engine_read_directly_at_once(tmp_path: Path) -> None:
    """Engines read from several threads (vLLM's loader, SGLang's I/O threads): concurrent
    direct reads on one attachment all hit, with the right bytes, and none fails."""
    errors: list[BaseException] = []
    with one_engine(tmp_path, 2) as (pool, ns, keys, datas):

        def reader() -> None:
            outs = [np.zeros_like(d) for d in datas]
            try:
                for _ in range(300):
                    assert pool.get_many_into(ns, keys, outs) == [True] * 2
                    assert all(np.array_equal(o, d) for o, d in zip(outs, datas, strict=True))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=reader) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert pool.stats()["attached"]["direct_hits"] > 0


def test_a_key_the_directory_lists_twice_never_stands_for_another(tmp_path: Path) -> None:
    """A lookup may list a key twice (it moved between two ways of its bucket while the
    ways were read); the other keys of the read are still copied or asked for, never taken
    as read because the count of what was found matched the count of keys."""
    with one_engine(tmp_path, 2) as (pool, ns, keys, datas):
        link = pool._link()
        assert link is not None and link.directory is not None
        directory = link.directory
        real = directory.find

        def twice_the_first(keys, ns_id, nbytes, arena):  # type: ignore[no-untyped-def]
            at, offsets, entries, seqs = real(keys, ns_id, nbytes, arena)
            return ([at[0], at[0]], [offsets[0], offsets[0]], entries[[0, 0]], seqs[[0, 0]])

        directory.find = twice_the_first  # type: ignore[method-assign]
        outs = [np.zeros_like(d) for d in datas]
        assert pool.get_many_into(ns, keys, outs) == [True, True]
        assert all(np.array_equal(o, d) for o, d in zip(outs, datas, strict=True))
        assert pool.stats()["attached"]["direct_hits"] == 1  # the second key was asked for
