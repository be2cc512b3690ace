"""The measuring half of ``kvpool bench sglang``; runs inside the SGLang venv.

``python -m kvpool.bench.sglang_runner SPEC_JSON OUT_JSON``. For each page size, SGLang's real
CPU host pool (layout ``page_first``) holds random pages; each system stores them and reads
them back into other host slots, in calls of ``batch`` pages, as SGLang's cache controller
calls its backend:

* ``kvpool`` (embedded) and ``kvpool_node`` (a client without DRAM of its own whose pages live
  on one ``kvpool serve`` node): ``batch_set_v1`` / ``batch_get_v1`` of KVPoolHiCacheStorage,
  created by SGLang's ``dynamic`` factory;
* ``file``: SGLang's bundled ``HiCacheFile`` (one file per page) on the controller's generic
  path: ``batch_set`` of ``get_data_page`` tensors, ``batch_get`` into flat pages then
  ``set_from_flat_data_page``. The OS page cache is dropped before every read pass
  (``FilePerChunkStore.drop_page_cache``), so its reads come from the disk, as a store that
  outgrew memory does.

Every pass writes fresh keys (a key already stored would be skipped by either backend). A
node's writes are acknowledged once queued for it (write-behind); the node is flushed before
the read pass, untimed. Every page read is compared byte for byte with the page written.

Failure contract: a failed call or a wrong byte raises BenchFailure (the run fails).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from kvpool.bench.stats import BenchFailure, Timing, run_pass
from kvpool.integrations.sglang import harness as h
from kvpool.peers.file_per_chunk import FilePerChunkStore

#: SmolLM2-135M's KV: 30 layers, 3 KV heads of 64, bf16.
LAYERS, HEADS, DIM = 30, 3, 64
LAYOUT = "page_first"


def _kvpool_config(work: Path, name: str, node: str | None, capacity: int) -> dict[str, Any]:
    if node is None:
        return {"cache_dir": str(work / name), "dram": {"capacity": capacity},
                "ssd": {"capacity": 2 * capacity, "segment_size": 64 << 20}}
    return {"cache_dir": str(work / name), "dram": {"capacity": 0}, "ssd": {"enabled": False},
            "cluster": {"nodes": [node], "write_behind_bytes": capacity}}


def _bench_system(name: str, backend: Any, host: Any, src: torch.Tensor, want: list[bytes],
                  spec: dict[str, Any], page: int, file_dir: Path | None) -> dict[str, Any]:
    batch, pages, repeats = spec["batch"][str(page)], spec["pages"][str(page)], spec["repeats"]
    calls = pages // batch
    dst = host.alloc(pages * page)
    page_bytes = len(want[0])
    sets, gets = Timing(page_bytes, items_per_op=batch), Timing(page_bytes, items_per_op=batch)
    legacy = name == "file"
    for rep in range(repeats):
        keys = [f"{rep:08x}{i:056x}" for i in range(pages)]

        def cut(c: int, idx: torch.Tensor, keys: list[str] = keys) -> tuple[list[str],
                                                                             torch.Tensor]:
            return keys[c * batch:(c + 1) * batch], idx[c * batch * page:(c + 1) * batch * page]

        def put(_t: int, c: int) -> bool:
            ks, idx = cut(c, src)
            if legacy:
                return bool(backend.batch_set(ks, [host.get_data_page(int(idx[i * page]))
                                                   for i in range(len(ks))]))
            return all(backend.batch_set_v1(ks, idx))

        def get(_t: int, c: int) -> bool:
            ks, idx = cut(c, dst)
            if legacy:
                flat = backend.batch_get(ks, [host.get_dummy_flat_data_page() for _ in ks])
                for i, data in enumerate(flat):
                    if data is None:
                        return False
                    host.set_from_flat_data_page(int(idx[i * page]), data)
                return True
            return all(backend.batch_get_v1(ks, idx))

        sets.add(run_pass(put, range(calls)))
        if name == "kvpool_node" and not backend.flush(120):
            raise BenchFailure("the node did not take the pages within 120 s")
        if file_dir is not None:
            FilePerChunkStore(file_dir).drop_page_cache()
        gets.add(run_pass(get, range(calls)))
        if h.page_bytes(host, dst) != want:
            raise BenchFailure(f"{name}: pages read back differ from the pages written")
    host.free(dst)
    return {"set": sets.summary(), "get": gets.summary()}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    work = Path(spec["work"])
    out: dict[str, Any] = {}
    for page in spec["page_sizes"]:
        pages = spec["pages"][str(page)]
        dev = h.device_pool(pages * page, page, LAYERS, HEADS, DIM)
        host = h.host_pool(dev, LAYOUT, ratio=2.0)
        src = host.alloc(pages * page)
        h.fill_random(host, src, page)
        want = h.page_bytes(host, src)
        capacity = (spec["repeats"] * len(want[0]) * pages * 5 // 4) + (64 << 20)
        row: dict[str, Any] = {"page_bytes": len(want[0])}
        systems: list[tuple[str, dict[str, Any] | None]] = [
            ("kvpool", {**h.DYNAMIC, "config": _kvpool_config(work, f"kv{page}", None,
                                                              capacity)}),
            ("file", None)]
        if spec.get("node"):
            systems.insert(1, ("kvpool_node", {**h.DYNAMIC, "config": _kvpool_config(
                work, f"kvn{page}", spec["node"], capacity)}))
        for name, extra in systems:
            print(f"[bench sglang] {page}-token pages: {name}", file=sys.stderr, flush=True)
            file_dir = work / f"file{page}" if extra is None else None
            backend = h.create_backend(
                "dynamic" if extra is not None else "file", host,
                extra if extra is not None else {"file_storage_path": str(file_dir)},
                model="SmolLM2-135M-Instruct")
            try:
                row[name] = _bench_system(name, backend, host, src, want, spec, page, file_dir)
            finally:
                if hasattr(backend, "close"):
                    backend.close()
        out[str(page)] = row
    return out


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(run(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
