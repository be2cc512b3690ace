"""FilePerChunkStore: the file-per-chunk benchmark peer and test oracle."""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from kvpool.errors import PoolClosedError
from kvpool.peers.file_per_chunk import FilePerChunkStore


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big") if i else os.urandom(16)


@pytest.fixture
def store(tmp_path: Path) -> FilePerChunkStore:
    return FilePerChunkStore(tmp_path / "fpc")


def test_put_get_roundtrip_and_layout(store: FilePerChunkStore) -> None:
    key = bytes.fromhex("abcdef0123456789abcdef0123456789")
    data = np.random.default_rng(1).integers(0, 256, 65536, dtype=np.uint8)
    assert store.put(key, data)
    path = store.directory / "ab" / "cd" / key.hex()
    assert path.is_file() and path.stat().st_size == 65536
    assert store.path_of(key) == path
    assert store.contains(key)
    out = np.zeros(65536, dtype=np.uint8)
    assert store.get_into(key, out)
    assert np.array_equal(out, data)
    assert len(store) == 1
    # no temporary files are left behind
    assert sorted(p.name for p in path.parent.iterdir()) == [key.hex()]


def test_get_into_accepts_mmap_bytearray_and_2d_arrays(store: FilePerChunkStore) -> None:
    key = _key(7)
    payload = bytes(range(256)) * 16
    assert store.put(key, memoryview(payload))
    buf = mmap.mmap(-1, 4096)
    assert store.get_into(key, buf)
    assert buf[:] == payload
    arr = np.zeros((16, 256), dtype=np.uint8)
    assert store.get_into(key, arr)
    assert arr.tobytes() == payload
    ba = bytearray(4096)
    assert store.get_into(key, ba) and bytes(ba) == payload


def test_missing_key_and_size_mismatch_are_misses(store: FilePerChunkStore) -> None:
    key = _key(1)
    out = bytearray(b"\x55" * 100)
    assert not store.get_into(key, out)
    assert not store.contains(key)
    assert store.put(key, b"x" * 64)
    assert not store.get_into(key, out)  # 100 != 64
    assert out == bytearray(b"\x55" * 100)  # untouched on a size mismatch
    small = bytearray(10)
    assert not store.get_into(key, small)


def test_truncated_file_is_a_miss(store: FilePerChunkStore) -> None:
    key = _key(2)
    assert store.put(key, b"a" * 8192)
    os.truncate(store.path_of(key), 4096)
    assert not store.get_into(key, bytearray(8192))


def test_overwrite_replaces_whole_file(store: FilePerChunkStore) -> None:
    key = _key(3)
    assert store.put(key, b"a" * 1000)
    assert store.put(key, b"b" * 500)
    out = bytearray(500)
    assert store.get_into(key, out) and out == b"b" * 500


def test_delete(store: FilePerChunkStore) -> None:
    key = _key(4)
    assert not store.delete(key)
    assert store.put(key, b"z" * 10)
    assert store.delete(key)
    assert not store.contains(key)
    assert not store.get_into(key, bytearray(10))
    assert not store.delete(key)


def test_durable_put(tmp_path: Path) -> None:
    with FilePerChunkStore(tmp_path / "d", durable=True) as s:
        key = _key(5)
        assert s.put(key, b"q" * 4096)
        out = bytearray(4096)
        assert s.get_into(key, out) and out == b"q" * 4096


def test_put_failure_returns_false_and_leaves_no_tmp(tmp_path: Path) -> None:
    s = FilePerChunkStore(tmp_path / "ro")
    key = bytes.fromhex("1122" + "00" * 14)
    # make the fan-out path a *file*, so creating the chunk's directory fails
    (tmp_path / "ro" / "11").write_bytes(b"not a directory")
    assert s.put(key, b"data") is False
    assert not s.contains(key)
    other = bytes.fromhex("3344" + "00" * 14)
    assert s.put(other, b"ok")


def test_clear_and_len(store: FilePerChunkStore) -> None:
    keys = [os.urandom(16) for _ in range(50)]
    for k in keys:
        assert store.put(k, k * 4)
    assert len(store) == 50
    store.clear()
    assert len(store) == 0
    assert list(store.directory.iterdir()) == []
    assert not any(store.contains(k) for k in keys)
    # still usable after clear (fan-out directories are recreated)
    assert store.put(keys[0], b"again")
    out = bytearray(5)
    assert store.get_into(keys[0], out) and out == b"again"


def test_drop_page_cache_keeps_data_readable(store: FilePerChunkStore) -> None:
    rng = np.random.default_rng(2)
    chunks = {os.urandom(16): rng.integers(0, 256, 16384, dtype=np.uint8) for _ in range(20)}
    for k, v in chunks.items():
        assert store.put(k, v)
    store.drop_page_cache()
    out = np.empty(16384, dtype=np.uint8)
    for k, v in chunks.items():
        assert store.get_into(k, out)
        assert np.array_equal(out, v)


def test_misuse_raises(store: FilePerChunkStore) -> None:
    with pytest.raises(ValueError):
        store.put(b"x", b"data")
    with pytest.raises(ValueError):
        store.contains("abcd")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        store.get_into(_key(1), b"read-only")
    assert store.put(_key(9), np.arange(10, dtype=np.uint8))
    with pytest.raises(TypeError):
        store.put(_key(9), np.arange(20, dtype=np.uint8)[::2])  # not contiguous
    store.close()
    store.close()  # idempotent
    with pytest.raises(PoolClosedError):
        store.put(_key(1), b"x")
    with pytest.raises(PoolClosedError):
        store.get_into(_key(1), bytearray(1))
    with pytest.raises(PoolClosedError):
        store.drop_page_cache()


def test_concurrent_writers_of_the_same_and_different_keys(store: FilePerChunkStore) -> None:
    shared = _key(11)
    payload = b"s" * 65536
    errors: list[BaseException] = []

    def writer(t: int) -> None:
        try:
            for i in range(40):
                assert store.put(shared, payload)
                own = (t * 1000 + i + 1).to_bytes(16, "little")
                assert store.put(own, own * 8)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    out = bytearray(65536)
    assert store.get_into(shared, out) and out == payload
    assert len(store) == 1 + 4 * 40
