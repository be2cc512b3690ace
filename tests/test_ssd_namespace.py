"""The SSD engine's namespace check on reads (issue 9, item 9: ``get_into(nsB, keyA)`` must
not return nsA's bytes).

With ``namespace_id`` given, a record stored under another namespace is a miss counted as
``namespace_mismatch`` (not a checksum failure) and stays readable under its own namespace,
across a reopen too; without it, reads behave as before.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from kvtest import CHUNK, byte_namespace, payload_for

from kvpool.ssd.engine import SsdEngine

MiB = 1 << 20
NS_A = byte_namespace(model="model-a")
NS_B = byte_namespace(model="model-b")
NS_BIG = byte_namespace(2 * CHUNK, model="model-big")


def k(i: int) -> bytes:
    return i.to_bytes(8, "little") + b"nscheck!"


def test_foreign_namespace_is_a_counted_miss_and_the_record_stays(tmp_path: Path) -> None:
    eng = SsdEngine(tmp_path, 8 * MiB, MiB)
    keys = [k(i) for i in range(6)]
    eng.put_many([(key, NS_A, payload_for(key)) for key in keys])
    out = np.zeros(CHUNK, np.uint8)
    for _ in range(2):  # a second pass: the first mismatch dropped nothing
        assert not eng.get_into(keys[0], out, namespace_id=NS_B.id)
        assert not out.any()  # refused from the index: not even read into out
        assert eng.get_many_into(keys, [np.empty(CHUNK, np.uint8) for _ in keys],
                                 namespace_id=NS_B.id) == [False] * 6
    st = eng.stats()
    assert st["namespace_mismatch"] == 14 and st["checksum_failures"] == 0
    assert st["records"] == 6
    assert eng.get_into(keys[0], out, namespace_id=NS_A.id)
    assert np.array_equal(out, payload_for(keys[0]))
    outs = [np.empty(CHUNK, np.uint8) for _ in keys]
    assert eng.get_many_into(keys, outs, namespace_id=NS_A.id) == [True] * 6
    assert all(np.array_equal(o, payload_for(key)) for o, key in zip(outs, keys, strict=True))
    assert eng.get_into(keys[1], out)  # no namespace given: no check, as before
    eng.close()
    eng = SsdEngine(tmp_path, 8 * MiB, MiB)  # the namespace comes back from the headers
    assert not eng.get_into(keys[2], out, namespace_id=NS_B.id)
    assert eng.get_into(keys[2], out, namespace_id=NS_A.id)
    assert np.array_equal(out, payload_for(keys[2]))
    assert eng.stats()["namespace_mismatch"] == 1
    eng.close()


def test_foreign_namespace_of_another_chunk_size_is_a_miss_not_an_error(
        tmp_path: Path) -> None:
    """nsB's buffer is the wrong size for nsA's record: with the namespace given that is a
    plain miss, checked before the size (without it, still a ChunkSizeError)."""
    eng = SsdEngine(tmp_path, 8 * MiB, MiB)
    eng.put(k(1), NS_A, payload_for(k(1)))
    big = np.empty(2 * CHUNK, np.uint8)
    assert not eng.get_into(k(1), big, namespace_id=NS_BIG.id)
    assert eng.get_many_into([k(1), k(2)], [big, big], namespace_id=NS_BIG.id) == [False] * 2
    assert eng.stats()["namespace_mismatch"] == 2
    eng.close()


def test_key_re_put_under_another_namespace_follows_the_newest(tmp_path: Path) -> None:
    """One key, two namespaces (only misuse makes keys collide): the index holds the newest
    record; reading it under the older namespace is a mismatch, not old bytes."""
    eng = SsdEngine(tmp_path, 8 * MiB, MiB)
    eng.put(k(1), NS_A, payload_for(k(1)))
    eng.put(k(1), NS_B, payload_for(k(2)))
    out = np.empty(CHUNK, np.uint8)
    assert not eng.get_into(k(1), out, namespace_id=NS_A.id)
    assert eng.get_into(k(1), out, namespace_id=NS_B.id)
    assert np.array_equal(out, payload_for(k(2)))
    eng.close()
