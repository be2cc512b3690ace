import errno
import logging
import os
import threading
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
from kvtest import CHUNK, byte_namespace, payload_for, small_config

from kvpool.errors import ChunkSizeError, PoolClosedError
from kvpool.ssd import directio
from kvpool.ssd.directio import aligned_buffer
from kvpool.ssd.engine import SsdEngine

MiB = 1 << 20


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_roundtrip_aligned_unaligned_and_odd_sizes(tmp_path: Path) -> None:
    eng = SsdEngine(tmp_path, 8 * MiB, MiB)
    assert eng.direct_io
    odd = byte_namespace(5000, model="odd")
    eng.put(k(1), byte_namespace(), payload_for(k(1)))
    eng.put(k(2), odd, payload_for(k(2), 5000))
    aligned = np.frombuffer(aligned_buffer(CHUNK), np.uint8)  # zero-copy O_DIRECT path
    assert eng.get_into(k(1), aligned) and np.array_equal(aligned, payload_for(k(1)))
    unaligned = np.zeros(CHUNK + 1, np.uint8)[1:]  # staged through an aligned buffer
    assert eng.get_into(k(1), unaligned) and np.array_equal(unaligned, payload_for(k(1)))
    small = np.zeros(5000, np.uint8)
    assert eng.get_into(k(2), small) and np.array_equal(small, payload_for(k(2), 5000))
    with pytest.raises(ChunkSizeError):
        eng.get_into(k(1), np.zeros(5000, np.uint8))
    assert not eng.get_into(k(3), small)
    eng.close()
    with pytest.raises(PoolClosedError):
        eng.get_into(k(1), aligned)


def test_get_many_into_runs_on_the_pool(tmp_path: Path) -> None:
    eng = SsdEngine(tmp_path, 8 * MiB, MiB, io_threads=4)
    ns = byte_namespace()
    keys = [k(i) for i in range(40)]
    assert eng.put_many([(x, ns, payload_for(x)) for x in keys[:30]]) == 30
    outs = [np.zeros(CHUNK, np.uint8) for _ in keys]
    assert eng.get_many_into(keys, outs) == [True] * 30 + [False] * 10
    assert all(np.array_equal(o, payload_for(x)) for o, x in zip(outs[:30], keys[:30],
                                                                 strict=True))
    assert eng.contains_many(keys, ns.id) == [True] * 30 + [False] * 10
    assert eng.contains_many(keys[:2], byte_namespace(model="other").id) == [False, False]
    eng.close()


def test_raw_region_mode_uses_one_existing_file(tmp_path: Path) -> None:
    region = tmp_path / "region.img"
    with open(region, "wb") as f:
        f.truncate(4 * MiB)
    ns = byte_namespace()
    eng = SsdEngine(region, 64 * MiB, MiB)  # capacity capped by the region's size
    assert eng.stats()["segments"] == 4
    eng.put_many([(k(i), ns, payload_for(k(i))) for i in range(20)])
    eng.close()
    assert region.stat().st_size == 4 * MiB
    assert list(tmp_path.iterdir()) == [region]
    eng = SsdEngine(region, 64 * MiB, MiB)
    out = np.zeros(CHUNK, np.uint8)
    assert eng.get_into(k(7), out) and np.array_equal(out, payload_for(k(7)))
    eng.close()


def test_buffered_mode_and_bad_geometry(tmp_path: Path) -> None:
    eng = SsdEngine(tmp_path / "b", 4 * MiB, MiB, direct_io="off")
    assert not eng.direct_io
    eng.put(k(1), byte_namespace(), payload_for(k(1)))
    out = np.zeros(CHUNK, np.uint8)
    assert eng.get_into(k(1), out) and np.array_equal(out, payload_for(k(1)))
    eng.close()
    with pytest.raises(ValueError, match="fewer than two segments"):
        SsdEngine(tmp_path / "c", MiB, MiB)
    with pytest.raises(ValueError, match="multiple of 4096"):
        SsdEngine(tmp_path / "d", 4 * MiB, MiB + 1)
    eng = SsdEngine(tmp_path / "e", 4 * MiB, MiB)
    with pytest.raises(ValueError, match="does not fit"):
        eng.put(k(1), byte_namespace(MiB), np.zeros(MiB, np.uint8))
    eng.close()


def test_changed_segment_size_starts_empty(tmp_path: Path) -> None:
    eng = SsdEngine(tmp_path, 4 * MiB, MiB)
    eng.put(k(1), byte_namespace(), payload_for(k(1)))
    eng.close()
    eng = SsdEngine(tmp_path, 4 * MiB, 2 * MiB)
    assert len(eng) == 0 and not eng.contains(k(1))
    assert sorted(p.stat().st_size for p in tmp_path.glob("seg-*.kvs")) == [2 * MiB, 2 * MiB]
    eng.close()


def test_odirect_refusal_falls_back_with_one_warning(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """No file system on this machine refuses O_DIRECT (tmpfs accepts it on this kernel),
    so the refusal is simulated at os.open."""
    real_open = os.open

    def refusing_open(path: str, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    monkeypatch.setattr(directio, "_warned_fallback", False)
    with caplog.at_level(logging.WARNING, logger="kvpool.ssd"):
        eng = SsdEngine(tmp_path / "a", 4 * MiB, MiB)
    assert not eng.direct_io
    assert sum("O_DIRECT is not supported" in r.message for r in caplog.records) == 1
    eng.put(k(1), byte_namespace(), payload_for(k(1)))
    out = np.zeros(CHUNK, np.uint8)
    assert eng.get_into(k(1), out) and np.array_equal(out, payload_for(k(1)))
    eng.close()
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(directio.DirectIOUnsupported):
        SsdEngine(tmp_path / "b", 4 * MiB, MiB, direct_io="on")
    # the refused open closed its fds, removed the file it created and released the lock
    assert set(os.listdir("/proc/self/fd")) == before
    assert not list((tmp_path / "b").glob("seg-*.kvs"))
    SsdEngine(tmp_path / "b", 4 * MiB, MiB, direct_io="off").close()


def test_large_reads_in_pieces_are_exact_and_verified(tmp_path: Path) -> None:
    """A single get_into of >= 1 MiB reads in pieces and hashes them as they land; the
    checksum still covers every byte, the last piece included."""
    size = 3 * MiB + 4096  # header piece + pieces + a short last one
    ns = byte_namespace(size, model="big")
    eng = SsdEngine(tmp_path, 16 * MiB, 8 * MiB)
    eng.put(k(1), ns, payload_for(k(1), size))
    eng.put(k(2), ns, payload_for(k(2), size))
    out = np.frombuffer(aligned_buffer(size), np.uint8)
    assert eng.get_into(k(1), out) and np.array_equal(out, payload_for(k(1), size))
    loc = eng._index.get(k(1))
    assert loc is not None
    eng.close()
    near_end = loc.block * 4096 + 4096 + size - 100  # inside the last piece of key 1
    with open(tmp_path / f"seg-{loc.segment:05d}.kvs", "r+b") as f:
        f.seek(near_end)
        b = f.read(1)[0]
        f.seek(near_end)
        f.write(bytes([b ^ 1]))
    eng = SsdEngine(tmp_path, 16 * MiB, 8 * MiB)
    assert not eng.get_into(k(1), out)
    assert eng.stats()["checksum_failures"] == 1
    assert eng.get_into(k(2), out) and np.array_equal(out, payload_for(k(2), size))
    eng.close()


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ 1]))


def _piece_threads() -> int:
    return sum(t.name.startswith("kvpool-ssd-piece") for t in threading.enumerate())


def test_read_pipeline_knobs_come_from_the_config(tmp_path: Path) -> None:
    """ssd.read_pipeline_min_bytes / read_piece_bytes / read_pipeline_threads: a 64 KiB read
    is split into 16 KiB pieces read on the piece threads (created only when a read splits),
    and the checksum still covers the last piece."""
    cfg = small_config(tmp_path, ssd={"read_pipeline_min_bytes": "64KiB",
                                      "read_piece_bytes": "16KiB", "read_pipeline_threads": 3})
    ns = byte_namespace(CHUNK)
    before = _piece_threads()
    with closing(SsdEngine.from_config(cfg)) as eng:
        eng.put(k(1), ns, payload_for(k(1)))
        eng.put(k(2), ns, payload_for(k(2)))  # after k(1): a bad k(1) is no torn tail
        out = np.frombuffer(aligned_buffer(CHUNK), np.uint8)
        assert eng.get_into(k(1), out) and np.array_equal(out, payload_for(k(1)))
        assert before < _piece_threads() <= before + 3
        loc = eng._index.get(k(1))
        assert loc is not None
    _flip_byte(cfg.ssd_path() / f"seg-{loc.segment:05d}.kvs",
               loc.block * 4096 + 4096 + CHUNK - 100)  # inside the last piece
    with closing(SsdEngine.from_config(cfg)) as eng:
        assert not eng.get_into(k(1), out)
        assert eng.stats()["checksum_failures"] == 1
        assert eng.get_into(k(2), out) and np.array_equal(out, payload_for(k(2)))
    with pytest.raises(ValueError, match="read_piece_bytes"):
        SsdEngine(tmp_path / "b", 4 * MiB, MiB, read_piece_bytes=5000)
    SsdEngine(tmp_path / "b", 4 * MiB, MiB).close()  # the refused open left no lock behind


@pytest.mark.parametrize(("verify", "cut"), [("64MiB", 1), (0, 0)])
def test_tail_verify_bytes_bounds_the_torn_tail_check(tmp_path: Path, verify: object,
                                                      cut: int) -> None:
    """A bad payload at the end of the newest segment is cut as a torn tail on open when it
    lies within ssd.tail_verify_bytes; outside it, it stays and reads as a counted miss."""
    cfg = small_config(tmp_path, ssd={"tail_verify_bytes": verify})
    ns = byte_namespace(CHUNK)
    with closing(SsdEngine.from_config(cfg)) as eng:
        for i in range(3):
            eng.put(k(i), ns, payload_for(k(i)))
        loc = eng._index.get(k(2))
        assert loc is not None
    _flip_byte(cfg.ssd_path() / f"seg-{loc.segment:05d}.kvs", loc.block * 4096 + 4096 + 10)
    out = np.frombuffer(aligned_buffer(CHUNK), np.uint8)
    with closing(SsdEngine.from_config(cfg)) as eng:
        assert eng.stats()["torn_discarded"] == cut
        assert len(eng) == 3 - cut
        assert not eng.get_into(k(2), out)
        assert eng.stats()["checksum_failures"] == 1 - cut
        assert eng.get_into(k(1), out) and np.array_equal(out, payload_for(k(1)))
