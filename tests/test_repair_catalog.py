"""KeyCatalog (server/catalog.py): the client keys a node stores, saved and loaded across a
restart; a damaged file is ignored, never fatal."""

from __future__ import annotations

from pathlib import Path

from kvtest import byte_namespace

from kvpool.server.catalog import KeyCatalog
from kvpool.server.store import scoped_chunk_key, scoped_chunk_keys


def test_saved_catalog_loads_with_its_namespaces_newest_first(tmp_path: Path) -> None:
    a, b = byte_namespace(4096, model="a"), byte_namespace(8192, model="b", salt="t:x")
    cat = KeyCatalog(tmp_path / "catalog", scoped_chunk_key)
    ka = [bytes([i]) * 16 for i in range(3)]
    kb = [bytes([100 + i]) * 16 for i in range(2)]
    cat.note(a, ka, scoped_chunk_keys(a.id, ka))
    cat.note(b, kb, scoped_chunk_keys(b.id, kb))
    generation = cat.generation
    cat.note(a, ka[:1], scoped_chunk_keys(a.id, ka[:1]))  # known: no change
    assert cat.generation == generation and cat.dirty()
    assert cat.save() and not cat.dirty()

    again = KeyCatalog(tmp_path / "catalog", scoped_chunk_key)
    assert again.load() == 5
    assert again.entries() == cat.entries()
    assert again.entries()[0][2] == kb[-1]  # newest first
    assert again.namespace(b.id) == b and again.namespace(a.id) == a
    again.forget([scoped_chunk_key(a.id, ka[0])])
    assert len(again) == 4


def test_a_damaged_or_missing_catalog_is_an_empty_one(tmp_path: Path) -> None:
    path = tmp_path / "catalog"
    assert KeyCatalog(path, scoped_chunk_key).load() == 0
    path.write_bytes(b"garbage")
    cat = KeyCatalog(path, scoped_chunk_key)
    assert cat.load() == 0 and len(cat) == 0
    good = KeyCatalog(path, scoped_chunk_key)
    ns = byte_namespace(4096)
    good.note(ns, [b"k" * 16], [scoped_chunk_key(ns.id, b"k" * 16)])
    good.save()
    path.write_bytes(path.read_bytes()[:-3])  # a torn entry
    assert KeyCatalog(path, scoped_chunk_key).load() == 0
    assert KeyCatalog(None, scoped_chunk_key).save() is False
