"""Misuse of the embedded pool's API raises a typed error naming the argument (never a silent
0 / False, never an AttributeError from deep inside); a chunk is only ever returned under the
namespace it was stored in, on every tier."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvtest import CHUNK, byte_namespace, payload_for, small_config

from kvpool import KVLayout, KVPool, Namespace
from kvpool.errors import ArgumentError


@pytest.fixture
def pool(tmp_path: Path) -> Any:
    with KVPool(small_config(tmp_path)) as p:
        yield p


def test_keys_of_the_wrong_shape_raise(pool: KVPool) -> None:
    ns = pool.register_namespace(byte_namespace())
    with pytest.raises(ArgumentError, match=r"keys\[0\]"):
        pool.lookup(ns, ["abc"])  # type: ignore[list-item]
    with pytest.raises(ArgumentError, match="keys must be a sequence"):
        pool.lookup(ns, b"x" * 32)
    with pytest.raises(ArgumentError, match=r"keys\[1\].*16 bytes, got 3 bytes"):
        pool.lookup(ns, [bytes(16), b"abc"])
    with pytest.raises(ArgumentError, match="key"):
        pool.contains(ns, 5)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="key"):
        pool.delete(ns, "k" * 16)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match=r"keys\[0\]"):
        pool.get_many_into(ns, [b"short"], [np.zeros(CHUNK, np.uint8)])
    with pytest.raises(ArgumentError, match=r"keys \(1\) and datas \(2\)"):
        pool.put_many(ns, [bytes(16)], [payload_for(bytes(16))] * 2)
    with pytest.raises(ArgumentError, match="keys"):
        pool.pin_many(ns, [None])  # type: ignore[list-item]
    # the same errors are still ValueErrors (what callers caught before)
    with pytest.raises(ValueError):
        pool.lookup(ns, ["abc"])  # type: ignore[list-item]


def test_wrong_namespace_and_config_types_raise(pool: KVPool, tmp_path: Path) -> None:
    with pytest.raises(ArgumentError, match=r"ns must be a kvpool Namespace.*got str"):
        pool.put("ns", bytes(16), payload_for(bytes(16)))  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="got NoneType"):
        pool.register_namespace(None)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="ns must be"):
        pool.lookup(b"\0" * 16, [bytes(16)])  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match=r"config must be a kvpool Config.*got dict"):
        KVPool({"cache_dir": str(tmp_path)})  # type: ignore[arg-type]


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"num_kv_heads": 2.5}, "num_kv_heads"),
    ({"num_layers": True}, "num_layers"),
    ({"head_dim": "64"}, "head_dim"),
    ({"dtype": None}, "dtype"),
    ({"engine_layout": 3}, "engine_layout"),
])
def test_layout_fields_are_type_checked(kwargs: dict[str, Any], field: str) -> None:
    args: dict[str, Any] = {"dtype": "float16", "num_layers": 2, "num_kv_heads": 2,
                            "head_dim": 64}
    args.update(kwargs)
    with pytest.raises(ArgumentError, match=rf"KVLayout\.{field}"):
        KVLayout(**args)


def test_namespace_fields_are_type_checked() -> None:
    layout = KVLayout("float16", 2, 2, 64)
    with pytest.raises(ArgumentError, match=r"Namespace.model"):
        Namespace(None, layout)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match=r"Namespace.tenant_salt"):
        Namespace("m", layout, tenant_salt=7)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match=r"Namespace.layout"):
        Namespace("m", {"dtype": "float16"})  # type: ignore[arg-type]
    # numpy ints are fine and hash like plain ints
    assert KVLayout("float16", np.int64(2), 2, 64) == layout
    assert Namespace("m", KVLayout("float16", np.int32(2), 2, 64)).id == Namespace("m", layout).id


@pytest.mark.parametrize("tiers", ["dram", "ssd", "both"])
def test_a_chunk_is_never_served_under_another_namespace(tmp_path: Path, tiers: str) -> None:
    """get_into(nsB, keyA) is a miss on every tier, and a lookup does not count it."""
    sections: dict[str, dict[str, Any]] = {"pool": {"ssd_write": "through"}}
    if tiers == "dram":
        sections["ssd"] = {"enabled": False}
    if tiers == "ssd":
        sections["dram"] = {"capacity": 0}
    ns_a, ns_b = byte_namespace(model="a"), byte_namespace(model="b")
    key = ns_a.chunk_keys(list(range(ns_a.chunk_tokens)))[0]
    with KVPool(small_config(tmp_path, **sections)) as pool:
        pool.register_namespace(ns_a)
        pool.register_namespace(ns_b)
        assert pool.put(ns_a, key, payload_for(key))
        for when in ("staged", "flushed"):
            if when == "flushed":
                pool.flush()
            out = np.zeros(CHUNK, np.uint8)
            assert not pool.get_into(ns_b, key, out), when
            assert pool.get_many_into(ns_b, [key], [out]) == [False], when
            assert pool.lookup(ns_b, [key]) == 0, when
            assert not pool.contains(ns_b, key), when
            pins = pool.pin_many(ns_b, [key])
            assert pins == [None], when
            assert pool.get_into(ns_a, key, out) and np.array_equal(out, payload_for(key))
        if tiers == "ssd":
            pool.close()
            with KVPool(small_config(tmp_path, **sections)) as again:  # after a restart
                again.register_namespace(ns_b)
                assert not again.get_into(ns_b, key, np.zeros(CHUNK, np.uint8))
                assert again.lookup(ns_b, [key]) == 0
