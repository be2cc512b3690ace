"""Prefix locality on the SSD: a batch saved in prefix order lands as back-to-back records in
one segment, and ``get_many_into`` of those keys reads each run of them with one preadv
(``coalesced_reads`` / ``coalesced_records``) while every record still passes its own checks:
a damaged record is a counted miss that costs none of its neighbours, and a run whose read
fails is read again record by record (each an ``io_error``, every record kept)."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import numpy as np
import pytest
from kvtest import byte_namespace, payload_for, small_config
from test_ssd_io_errors import reads_fail

from kvpool.errors import ChunkSizeError
from kvpool.record import BLOCK, HEADER_BLOCK, record_size
from kvpool.ssd.directio import aligned_buffer
from kvpool.ssd.engine import SsdEngine
from kvpool.ssd.index import Location

MiB = 1 << 20
CHUNK = 64 * 1024
N = 20  # records of one prefix: 1.3 MiB, well inside one 4 MiB segment


def k(i: int) -> bytes:
    return i.to_bytes(8, "little") + b"coalesce"


def engine_at(path: Path, **kwargs: object) -> SsdEngine:
    return SsdEngine(path, 16 * MiB, 4 * MiB, **kwargs)  # type: ignore[arg-type]


def save_prefix(eng: SsdEngine, keys: list[bytes], size: int = CHUNK) -> None:
    ns = byte_namespace(size)
    assert eng.put_many([(x, ns, payload_for(x, size)) for x in keys]) == len(keys)


def loc(eng: SsdEngine, key: bytes) -> Location:
    found = eng._index.get(key)
    assert found is not None
    return found


def aligned_out(size: int) -> np.ndarray:
    return np.frombuffer(aligned_buffer(size), np.uint8, size)


def unaligned_out(size: int) -> np.ndarray:
    return np.zeros(size + 1, np.uint8)[1:]  # O_DIRECT cannot land here: staged


def damage(eng: SsdEngine, key: bytes, offset_in_record: int) -> None:
    """Flip one byte of ``key``'s record on the medium (header block at offset 0)."""
    where = loc(eng, key)
    fd = eng._store.fd(where.segment)
    at = eng._store.base(where.segment) + where.block * BLOCK + offset_in_record
    raw = os.open(os.readlink(f"/proc/self/fd/{fd}"), os.O_RDWR)
    try:
        os.pwrite(raw, bytes([os.pread(raw, 1, at)[0] ^ 0x10]), at)
        os.fsync(raw)
    finally:
        os.close(raw)


@pytest.mark.parametrize("size", [CHUNK, 5000])
def test_a_prefix_batch_lands_back_to_back_in_one_segment(tmp_path: Path, size: int) -> None:
    eng = engine_at(tmp_path)
    try:
        keys = [k(i) for i in range(N)]
        save_prefix(eng, keys, size)
        locs = [loc(eng, x) for x in keys]
        assert {x.segment for x in locs} == {locs[0].segment}
        for prev, cur in itertools.pairwise(locs):
            assert cur.block == prev.block + prev.blocks
            assert cur.blocks * BLOCK == record_size(size)
    finally:
        eng.close()


# a run of N records is read in pieces of about read_piece_bytes (each record its own piece,
# the default 512 KiB, or one preadv for the whole run) while the pieces before are checked
PIECES = [BLOCK, 512 << 10, 8 * MiB]


@pytest.mark.parametrize("piece", PIECES)
@pytest.mark.parametrize("direct_io", ["auto", "off"])
@pytest.mark.parametrize(("size", "out_kind"),
                         [(CHUNK, "aligned"), (CHUNK, "unaligned"), (5000, "aligned"),
                          (5000, "unaligned")])
def test_get_many_into_reads_a_prefix_in_one_read(tmp_path: Path, direct_io: str, size: int,
                                                  out_kind: str, piece: int) -> None:
    eng = engine_at(tmp_path, direct_io=direct_io, read_piece_bytes=piece)
    try:
        assert eng.direct_io == (direct_io == "auto")
        keys = [k(i) for i in range(N)]
        save_prefix(eng, keys, size)
        make = aligned_out if out_kind == "aligned" else unaligned_out
        outs = [make(size) for _ in keys]
        assert eng.get_many_into(keys, outs) == [True] * N
        for x, out in zip(keys, outs, strict=True):
            assert np.array_equal(out, payload_for(x, size))
        st = eng.stats()
        assert st["coalesced_reads"] == 1 and st["coalesced_records"] == N
        assert st["hits"] == N and st["misses"] == 0 and st["gets"] == N
    finally:
        eng.close()


def test_the_size_cap_splits_runs_and_zero_turns_coalescing_off(tmp_path: Path) -> None:
    keys = [k(i) for i in range(N)]
    for cap, runs in ((3 * record_size(CHUNK), 7), (0, 0), (8 * MiB, 1)):
        path = tmp_path / str(cap)
        eng = engine_at(path, coalesce_max_bytes=cap)
        try:
            save_prefix(eng, keys)
            outs = [aligned_out(CHUNK) for _ in keys]
            assert eng.get_many_into(keys, outs) == [True] * N
            assert all(np.array_equal(o, payload_for(x)) for o, x in zip(outs, keys,
                                                                         strict=True))
            st = eng.stats()
            assert st["coalesced_reads"] == runs, cap
            assert st["coalesced_records"] == (N if runs else 0), cap
        finally:
            eng.close()


def test_runs_follow_the_order_asked_and_stop_at_gaps(tmp_path: Path) -> None:
    eng = engine_at(tmp_path)
    try:
        keys = [k(i) for i in range(N)]
        save_prefix(eng, keys)
        other = byte_namespace(model="other")
        assert eng.put(k(100), other, payload_for(k(100)))
        # reversed: no record starts where the one asked before it ends
        outs = [aligned_out(CHUNK) for _ in keys]
        assert eng.get_many_into(keys[::-1], outs) == [True] * N
        assert all(np.array_equal(o, payload_for(x)) for o, x in zip(outs, keys[::-1],
                                                                     strict=True))
        assert eng.stats()["coalesced_reads"] == 0
        # a record left out splits the prefix into two runs; keys that miss (absent, or
        # another namespace's) cost no IO and split nothing
        asked = [*keys[:5], k(999), *keys[6:11], k(100), *keys[11:13]]
        outs = [aligned_out(CHUNK) for _ in asked]
        ns_id = byte_namespace().id
        assert eng.get_many_into(asked, outs, namespace_id=ns_id) == \
            [True] * 5 + [False] + [True] * 5 + [False] + [True] * 2
        assert all(np.array_equal(o, payload_for(x)) for o, x, ok in zip(
            outs, asked, [True] * 5 + [False] + [True] * 5 + [False] + [True] * 2,
            strict=True) if ok)
        st = eng.stats()
        assert st["coalesced_reads"] == 2 and st["coalesced_records"] == 12
        assert st["namespace_mismatch"] == 1
        # a wrong-sized buffer raises before any read
        with pytest.raises(ChunkSizeError):
            eng.get_many_into(keys[:3], [aligned_out(CHUNK)] * 2 + [aligned_out(4096)])
        assert eng.stats()["coalesced_reads"] == 2
        assert eng.stats()["hits"] == 2 * N - 8
    finally:
        eng.close()


@pytest.mark.parametrize("piece", PIECES)
@pytest.mark.parametrize("offset", [HEADER_BLOCK + 1234, 20],
                         ids=["payload", "header"])
def test_a_damaged_record_in_a_run_costs_no_neighbour(tmp_path: Path, offset: int,
                                                      piece: int) -> None:
    eng = engine_at(tmp_path, read_piece_bytes=piece)
    try:
        keys = [k(i) for i in range(N)]
        save_prefix(eng, keys)
        bad = N // 2
        damage(eng, keys[bad], offset)
        outs = [aligned_out(CHUNK) for _ in keys]
        got = eng.get_many_into(keys, outs)
        assert got == [i != bad for i in range(N)]
        for i, (x, out) in enumerate(zip(keys, outs, strict=True)):
            if i != bad:
                assert np.array_equal(out, payload_for(x)), i
        st = eng.stats()
        assert st["coalesced_reads"] == 1
        assert st["checksum_failures"] == 1 and st["misses"] == 1 and st["hits"] == N - 1
        assert st["io_errors"] == 0 and st["stale_reads"] == 0
        assert len(eng) == N - 1 and not eng.contains(keys[bad])  # dropped, as get_into does
        # the rest is still one run on each side of the hole
        outs = [aligned_out(CHUNK) for _ in keys]
        assert eng.get_many_into(keys, outs) == [i != bad for i in range(N)]
        assert eng.stats()["coalesced_reads"] == 3
    finally:
        eng.close()


@pytest.mark.parametrize("piece", PIECES)
def test_a_failed_run_read_is_retried_record_by_record(tmp_path: Path, piece: int) -> None:
    eng = engine_at(tmp_path, read_piece_bytes=piece)
    try:
        keys = [k(i) for i in range(N)]
        save_prefix(eng, keys)
        outs = [aligned_out(CHUNK) for _ in keys]
        with reads_fail(eng, loc(eng, keys[0]).segment):
            assert eng.get_many_into(keys, outs) == [False] * N
        st = eng.stats()
        assert st["io_errors"] == N and st["checksum_failures"] == 0 and st["misses"] == N
        assert st["coalesced_reads"] == 0
        assert eng.get_many_into(keys, outs) == [True] * N  # every record was kept
        assert all(np.array_equal(o, payload_for(x)) for o, x in zip(outs, keys, strict=True))
    finally:
        eng.close()


def test_coalesce_max_bytes_comes_from_the_config(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, ssd={"coalesce_max_bytes": "256KiB"})
    assert cfg.ssd.coalesce_max_bytes == 256 * 1024
    eng = SsdEngine.from_config(cfg)
    try:
        keys = [k(i) for i in range(8)]
        save_prefix(eng, keys)
        outs = [aligned_out(CHUNK) for _ in keys]
        assert eng.get_many_into(keys, outs) == [True] * 8
        # 68 KiB records: three to a 256 KiB run
        assert eng.stats()["coalesced_reads"] == 3
    finally:
        eng.close()


def test_a_prefix_copied_forward_stays_in_order_and_one_read(tmp_path: Path) -> None:
    """Copy-forward rewrites the hot records of the evicted segment in the order they were
    written (the index lists them in hash order): a prefix that was read stays back to back
    in prefix order at the log head, so reading it again is still one coalesced read."""
    eng = SsdEngine(tmp_path, 8 * MiB, 2 * MiB, eviction="second_chance",
                    copy_forward_fraction=0.9)
    try:
        # 12 x 68 KiB in the first 2 MiB segment; random keys, as real chunk keys are (the
        # index files a key by its leading bytes: k(i) would list them in order by luck)
        prefix = [os.urandom(16) for _ in range(12)]
        save_prefix(eng, prefix)
        outs = [aligned_out(CHUNK) for _ in prefix]
        assert eng.get_many_into(prefix, outs) == [True] * len(prefix)  # now hot
        filler = iter(range(1000, 1400))
        while eng.stats()["copied_forward"] == 0:  # until its segment is evicted
            save_prefix(eng, [k(next(filler)) for _ in range(4)])
        assert eng.stats()["copied_forward"] == len(prefix)  # only the prefix was read
        blocks = [loc(eng, key).block for key in prefix]
        assert len({loc(eng, key).segment for key in prefix}) == 1
        assert blocks == sorted(blocks)  # prefix order kept
        before = eng.stats()
        assert eng.get_many_into(prefix, outs) == [True] * len(prefix)
        after = eng.stats()
        assert after["coalesced_reads"] - before["coalesced_reads"] == 1
        assert after["coalesced_records"] - before["coalesced_records"] == len(prefix)
        for key, out in zip(prefix, outs, strict=True):
            assert np.array_equal(out, payload_for(key, CHUNK))
    finally:
        eng.close()


def test_a_failed_piece_costs_only_the_records_not_yet_checked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run read in pieces (read_piece_bytes) checks each piece's records as it lands: when
    a later piece's read fails (a bad range of the medium), the records of the pieces before
    it are hits from the run, not read again, and only the rest are read alone (here
    failing again: counted io_errors, kept in the index)."""
    piece = 256 * 1024  # whole records of ~256 KiB: 4 records of 68 KiB per piece
    eng = engine_at(tmp_path, read_piece_bytes=piece)
    try:
        keys = [k(i) for i in range(N)]
        save_prefix(eng, keys)
        first = loc(eng, keys[0])
        bad_from = eng._store.base(first.segment) + loc(eng, keys[8]).block * BLOCK
        real_preadv = os.preadv
        good_reads: list[int] = []

        def preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
            if offset >= bad_from:
                raise OSError(5, "Input/output error (injected: a bad range)")
            good_reads.append(offset)
            return real_preadv(fd, buffers, offset)

        monkeypatch.setattr(os, "preadv", preadv)
        outs = [aligned_out(CHUNK) for _ in keys]
        assert eng.get_many_into(keys, outs) == [i < 8 for i in range(N)]
        assert all(np.array_equal(outs[i], payload_for(keys[i])) for i in range(8))
        assert len(good_reads) == 2  # the first two pieces, each once: not read again alone
        st = eng.stats()
        assert st["io_errors"] == N - 8 and st["hits"] == 8 and st["coalesced_reads"] == 0
        monkeypatch.setattr(os, "preadv", real_preadv)
        assert eng.get_many_into(keys, outs) == [True] * N  # every record was kept
    finally:
        eng.close()
