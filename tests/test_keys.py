import json
import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from kvpool.keys import KVLayout, Namespace, canonical_json, chunk_keys

SMOL = Namespace("SmolLM2-135M", KVLayout("float32", 30, 3, 64, 4))

# Known-answer vectors: computed once and frozen. If one of these changes, every stored chunk
# of every user becomes unreachable -- that is a format change, not a refactor.
SMOL_ID = "b3f2a286cd91e5587f4ecc679558a82e"
SMOL_LAYOUT_ID = 0x458AFE018C1AF83E
SMOL_KEYS_0_TO_9 = ["7309540d1bcf16e3aa2c9eab034bf084", "e05b9a63109681ef295f854260a2a7c8"]
ZERO_NS_KEY_1 = "a7e4d44045b5f39ac32bcef88b43f991"


def test_known_answer_vectors() -> None:
    assert SMOL.id.hex() == SMOL_ID
    assert SMOL.layout_id == SMOL_LAYOUT_ID
    assert [k.hex() for k in SMOL.chunk_keys(list(range(10)))] == SMOL_KEYS_0_TO_9
    assert chunk_keys(bytes(16), [1, 2, 3, 4], 2)[1].hex() == ZERO_NS_KEY_1


def test_key_formula_is_the_documented_chain() -> None:
    tokens = list(range(100, 112))
    prev = bytes(16)
    expected = []
    for i in range(3):
        raw = np.asarray(tokens[i * 4:(i + 1) * 4], dtype="<u4").tobytes()
        prev = xxhash.xxh3_128_digest(SMOL.id + prev + raw)
        expected.append(prev)
    assert SMOL.chunk_keys(tokens) == expected
    assert SMOL.id == xxhash.xxh3_128_digest(canonical_json(SMOL.canonical()))


def test_partial_chunk_gets_no_key_and_prefixes_share_keys() -> None:
    assert SMOL.chunk_keys([1, 2, 3]) == []
    a = SMOL.chunk_keys(list(range(11)))
    b = SMOL.chunk_keys([*range(8), 99, 98, 97, 96])
    assert len(a) == 2 and len(b) == 3
    assert a[:2] == b[:2]
    assert SMOL.chunk_keys(list(range(12)))[2] != b[2]


def test_numpy_and_list_tokens_agree() -> None:
    toks = [5, 70000, 2**32 - 1, 0] * 3
    assert SMOL.chunk_keys(toks) == SMOL.chunk_keys(np.asarray(toks, dtype=np.int64))


@pytest.mark.parametrize("change", [
    {"model": "other"}, {"revision": "v2"}, {"tenant_salt": "tenant-b"},
])
def test_namespace_fields_change_keys(change: dict[str, str]) -> None:
    fields = {"model": SMOL.model, "layout": SMOL.layout, "revision": SMOL.revision,
              "tenant_salt": SMOL.tenant_salt, **change}
    other = Namespace(**fields)  # type: ignore[arg-type]
    assert other.id != SMOL.id
    assert other.chunk_keys(range(4)) != SMOL.chunk_keys(range(4))


def test_layout_changes_keys() -> None:
    for layout in (KVLayout("bfloat16", 30, 3, 64, 4), KVLayout("float32", 30, 3, 64, 4, tp_rank=1,
                                                                 tp_size=2)):
        assert Namespace("SmolLM2-135M", layout).id != SMOL.id


def test_bad_input_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        SMOL.chunk_keys([-1, 2, 3, 4])
    with pytest.raises(ValueError, match="integers"):
        SMOL.chunk_keys([0.5, 1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="16 bytes"):
        chunk_keys(b"short", [1, 2], 1)
    with pytest.raises(ValueError, match="dtype"):
        KVLayout("float64x", 1, 1, 1)
    with pytest.raises(ValueError, match="num_layers"):
        KVLayout("float32", 0, 1, 1)


def test_chunk_bytes_is_layer_major_size() -> None:
    assert SMOL.layout.bytes_per_token == 46080  # SmolLM2-135M fp32: 30 layers x 2 x 3 x 64 x 4
    assert SMOL.chunk_bytes == 46080 * 4
    assert SMOL.layout.layer_bytes * 30 == SMOL.chunk_bytes


_CHILD = """
import json, sys
from kvpool.keys import KVLayout, Namespace
ns = Namespace("m", KVLayout("bfloat16", 4, 2, 64, 16), tenant_salt="t")
print(json.dumps([ns.id.hex()] + [k.hex() for k in ns.chunk_keys(list(range(64)))]))
"""


def test_keys_equal_across_processes_with_different_hash_seeds() -> None:
    outputs = []
    for seed in ("0", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        res = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                             text=True, check=True)
        outputs.append(json.loads(res.stdout))
    assert outputs[0] == outputs[1] == outputs[2]
    assert len(outputs[0]) == 5
