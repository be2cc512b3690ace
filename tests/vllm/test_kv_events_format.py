"""kvpool's KV event batches parse with vLLM's own msgspec structures (the class definitions
of ``vllm/distributed/kv_events.py`` in the vLLM venv, the release the tests pin): a
vLLM-event consumer reads a node's events, kvpool's extra fields ignored."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from kvpool.events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode,
    encode,
)

DECODE = """
import ast, json, sys, sysconfig
from pathlib import Path
from typing import Any
import msgspec
from msgspec.msgpack import Decoder
# vLLM's own class definitions, taken from its source without importing vllm (whose import
# takes over a minute here): exactly the structures a vLLM-event consumer decodes with
source = Path(sysconfig.get_paths()["purelib"], "vllm/distributed/kv_events.py").read_text()
wanted = {"EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared",
          "KVEventBatch"}
tree = ast.parse(source)
tree.body = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in wanted]
assert {n.name for n in tree.body} == wanted, "vLLM's kv_events.py changed"
scope = {"msgspec": msgspec, "Any": Any, "ExternalBlockHash": bytes | int}
exec(compile(tree, "kv_events.py", "exec"), scope)
batch = Decoder(type=scope["KVEventBatch"]).decode(open(sys.argv[1], "rb").read())
out = []
for e in batch.events:
    d = {"type": type(e).__name__}
    for f in ("block_hashes", "block_size", "medium", "parent_block_hash", "token_ids"):
        if hasattr(e, f):
            v = getattr(e, f)
            d[f] = [h.hex() for h in v] if f == "block_hashes" else v
    out.append(d)
print(json.dumps({"ts": batch.ts, "dp": batch.data_parallel_rank, "events": out}))
"""


def test_vllm_decodes_a_kvpool_batch(vllm_python: Path, tmp_path: Path) -> None:
    keys = [bytes([i]) * 16 for i in range(3)]
    ns_id = bytes(range(16))
    batch = KVEventBatch(ts=12.5, events=[
        BlockStored(keys, None, [], 256, None, "CPU", None, ns_id, "tenant-a"),
        BlockRemoved(keys[:1], "DISK", ns_id, "tenant-a"),
        AllBlocksCleared("DISK", ns_id)], node="node-a", incarnation="abc",
        key_scope="namespace")
    payload = encode(batch)
    assert decode(payload) == batch  # kvpool's own round trip keeps its fields
    (tmp_path / "batch.bin").write_bytes(payload)
    (tmp_path / "decode.py").write_text(DECODE)
    out = subprocess.run([str(vllm_python), str(tmp_path / "decode.py"),
                          str(tmp_path / "batch.bin")], capture_output=True, text=True,
                         timeout=120, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["ts"] == 12.5 and seen["dp"] is None
    assert seen["events"] == [
        {"type": "BlockStored", "block_hashes": [k.hex() for k in keys], "block_size": 256,
         "medium": "CPU", "parent_block_hash": None, "token_ids": []},
        {"type": "BlockRemoved", "block_hashes": [keys[0].hex()], "medium": "DISK"},
        {"type": "AllBlocksCleared"}]
