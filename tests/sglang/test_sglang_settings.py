"""The SGLang backend's pure parts (no SGLang, no torch): extra-config settings, namespace,
keys and page payload layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.errors import ConfigError
from kvpool.integrations.sglang.layout import (
    PageGeometry,
    RankIdentity,
    make_namespace,
    page_key,
)
from kvpool.integrations.sglang.settings import parse_settings

DYNAMIC = {"backend_name": "kvpool", "module_path": "kvpool.integrations.sglang",
           "class_name": "KVPoolHiCacheStorage", "interface_v1": 1}


def geom(layout: str = "page_first", page_size: int = 64) -> PageGeometry:
    return PageGeometry(layout=layout, dtype="bfloat16", layers=30, heads=3, head_dim=64,
                        page_size=page_size)


def test_sglang_keys_are_passed_over_and_kvpool_keys_validated(tmp_path: Path) -> None:
    s = parse_settings({**DYNAMIC, "tenant_salt": "t1",
                        "config": {"cache_dir": str(tmp_path), "dram": {"capacity": "1GiB"}}})
    assert s.tenant_salt == "t1"
    assert s.pool_config().dram.capacity == 1 << 30
    assert s.pool_config(tp_rank=1, tp_size=2).ssd.path.endswith("tp1")


@pytest.mark.parametrize(("extra", "message"), [
    ({"tenant_sault": "x"}, "hicache_storage_backend_extra_config.tenant_sault: unknown key"),
    ({"config_path": "/nonexistent.yaml"},
     "hicache_storage_backend_extra_config.config_path: no such file"),
    ({"config": ["dram"]}, "hicache_storage_backend_extra_config.config"),
    ({"config": {"dram": {"capacity": "lots"}}}, "dram.capacity"),
])
def test_bad_extra_config_names_the_key(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        parse_settings({**DYNAMIC, **extra})


def test_namespace_separates_what_makes_pages_incompatible() -> None:
    base = make_namespace(RankIdentity("m", tp_rank=0, tp_size=2), geom())
    assert base.chunk_bytes == geom().page_bytes == 64 * 30 * 2 * 3 * 64 * 2
    others = [
        make_namespace(RankIdentity("m2", tp_rank=0, tp_size=2), geom()),
        make_namespace(RankIdentity("m", tp_rank=1, tp_size=2), geom()),
        make_namespace(RankIdentity("m", tp_rank=0, tp_size=2, pp_rank=1, pp_size=2), geom()),
        make_namespace(RankIdentity("m", tp_rank=0, tp_size=2), geom("layer_first")),
        make_namespace(RankIdentity("m", tp_rank=0, tp_size=2), geom(page_size=256)),
        make_namespace(RankIdentity("m", tp_rank=0, tp_size=2), geom(), tenant_salt="t"),
    ]
    assert len({base.id, *(ns.id for ns in others)}) == 1 + len(others)
    # MLA: every tensor-parallel rank holds the same latent KV, so all share one namespace
    mla = [make_namespace(RankIdentity("m", tp_rank=r, tp_size=4, is_mla=True), geom())
           for r in range(4)]
    assert len({ns.id for ns in mla}) == 1


def test_page_keys_are_deterministic_and_namespaced() -> None:
    ns_a = make_namespace(RankIdentity("a"), geom())
    ns_b = make_namespace(RankIdentity("b"), geom())
    h = "ab" * 32
    assert page_key(ns_a, h) == page_key(ns_a, h)
    assert len(page_key(ns_a, h)) == 16
    assert page_key(ns_a, h) != page_key(ns_b, h)
    assert page_key(ns_a, h) != page_key(ns_a, "cd" * 32)
    # a key that is not 64-hex (a legacy caller's own) is hashed as its text
    assert page_key(ns_a, "not-hex-" * 8) != page_key(ns_a, "not-hex")


def test_layer_first_pieces_land_at_their_flat_page_offsets() -> None:
    g = PageGeometry(layout="layer_first", dtype="float16", layers=3, heads=1, head_dim=4,
                     page_size=2)
    s = g.piece_bytes
    assert s == 2 * 4 * 2
    # SGLang's piece order K0 V0 K1 V1 K2 V2 -> flat [2, layers, ...]: K0 K1 K2 V0 V1 V2
    assert g.piece_offsets() == [0, 3 * s, s, 4 * s, 2 * s, 5 * s]
    assert geom("page_first_direct").piece_offsets() == [0, geom().piece_bytes]


def test_layouts_kvpool_cannot_copy_are_refused() -> None:
    with pytest.raises(ValueError, match="page_head"):
        geom("page_head")


def test_retention_setting_is_checked() -> None:
    from kvpool.integrations.retention import retention_now
    from kvpool.retention import Priority

    settings = parse_settings({**DYNAMIC, "retention": {"priority": "high", "ttl_s": 30}})
    first = retention_now(settings.retention)
    assert first is not None and first.priority is Priority.HIGH
    assert first.expires_at is not None
    with pytest.raises(ConfigError, match=r"hicache_storage_backend_extra_config\.retention"):
        parse_settings({"retention": {"priority": "forever"}})
    with pytest.raises(ConfigError, match="mapping"):
        parse_settings({"retention": "pin"})
