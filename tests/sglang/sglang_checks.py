"""Scenarios run by the SGLang venv's python (``tests/sglang/conftest.py`` ``run_check``):
``python sglang_checks.py NAME ARGS_JSON`` prints one JSON object, the scenario's findings;
``python sglang_checks.py batch '[[NAME, ARGS], ...]'`` runs several in one process (importing
SGLang costs ~10 s a process) and prints one ``RESULT`` line each, in order.
Every scenario builds SGLang's real CPU device pool and host pool and creates the backend
through SGLang's own factory (``kvpool.integrations.sglang.harness``)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from kvpool.integrations.sglang import harness as h

PAGE, LAYERS, HEADS, DIM = 16, 3, 2, 8
#: The config of a model SGLang's server args can resolve offline (no weights are read).
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
              "hidden_size": HEADS * DIM * 2, "intermediate_size": 64,
              "num_hidden_layers": LAYERS, "num_attention_heads": HEADS * 2,
              "num_key_value_heads": HEADS, "max_position_embeddings": 2048,
              "torch_dtype": "bfloat16"}


def pool_config(cache_dir: str, **more: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"cache_dir": cache_dir,
                           "dram": {"capacity": "32MiB", "slab_size": "8MiB"},
                           "ssd": {"capacity": "64MiB", "segment_size": "8MiB"}}
    cfg.update(more)
    return cfg


def keys_for(n: int, salt: int = 0) -> list[str]:
    return [f"{salt:032x}{i:032x}" for i in range(n)]


def roundtrip(args: dict[str, Any]) -> dict[str, Any]:
    """v1 write, v1 and legacy reads; legacy write, v1 read; misses; batch_exists' gaps."""
    dev = h.device_pool(1024, PAGE, LAYERS, HEADS, DIM)
    host = h.host_pool(dev, args["layout"])
    backend = h.create_backend("dynamic", host,
                               {**h.DYNAMIC, "config": pool_config(args["cache_dir"])})
    out: dict[str, Any] = {"class": type(backend).__name__}
    n = 6
    src = host.alloc(n * PAGE)
    h.fill_random(host, src, 1)
    want = h.page_bytes(host, src)
    keys = keys_for(n)
    out["set_v1"] = backend.batch_set_v1(keys, src)
    dst = host.alloc(n * PAGE)
    out["get_v1"] = backend.batch_get_v1(keys, dst)
    out["v1_bytes_equal"] = h.page_bytes(host, dst) == want
    legacy = backend.batch_get(keys)
    out["legacy_get_equal"] = [t is not None and t.view(torch.uint8).numpy().tobytes() == w
                               for t, w in zip(legacy, want, strict=True)]
    # legacy write (flat pages, as SGLang's generic path sends them), v1 read
    lkeys = keys_for(n, salt=1)
    out["legacy_set"] = backend.batch_set(lkeys, [host.get_data_page(int(src[i * PAGE]))
                                                  for i in range(n)])
    dst2 = host.alloc(n * PAGE)
    out["get_v1_of_legacy"] = backend.batch_get_v1(lkeys, dst2)
    out["v1_of_legacy_equal"] = h.page_bytes(host, dst2) == want
    # misses
    missing = keys_for(1, salt=9)[0]
    out["exists_missing"] = backend.exists(missing)
    out["get_missing"] = backend.get(missing) is None
    out["get_v1_missing"] = backend.batch_get_v1([missing], host.alloc(PAGE))
    # batch_exists stops at the first gap
    out["exists_full"] = backend.batch_exists(keys)
    out["exists_gap"] = backend.batch_exists([*keys[:2], missing, *keys[2:]])
    out["exists_first_missing"] = backend.batch_exists([missing, *keys])
    out["stats"] = backend.stats()["backend"]
    out["metrics"] = engine_metrics(backend)
    io = backend.get_stats()  # SGLang's StorageMetrics since the last call
    out["io"] = {"type": type(io).__name__, "prefetch_pgs": io.prefetch_pgs,
                 "backup_pgs": io.backup_pgs, "again": backend.get_stats().prefetch_pgs}
    out["cleared"] = backend.clear()
    out["exists_after_clear"] = backend.batch_exists(keys)
    backend.close()
    out["exists_after_close"] = backend.batch_exists(keys)
    return out


def engine_metrics(backend: Any) -> dict[str, float]:
    """The pool's engine metrics (label engine="sglang") as its registry exports them."""
    from prometheus_client import generate_latest

    found = {}
    for line in generate_latest(backend.pool.metrics).decode().splitlines():
        if line.startswith("kvpool_engine_") and 'engine="sglang"' in line:
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


def threads(args: dict[str, Any]) -> dict[str, Any]:
    """Three threads (as the controller's backup, prefetch and prefetch-IO threads) store,
    look up and read pages at once, half of the keys shared between the threads; the DRAM
    tier is small, so slots are evicted (to the SSD) while other threads pin and fill them."""
    dev = h.device_pool(4096, PAGE, LAYERS, HEADS, DIM)
    host = h.host_pool(dev, "layer_first", ratio=4.0)
    backend = h.create_backend("dynamic", host, {**h.DYNAMIC, "config": pool_config(
        args["cache_dir"], dram={"capacity": "1MiB", "slab_size": "256KiB"})})
    n, rounds = 8, int(args.get("rounds", 30))
    src = host.alloc(3 * n * PAGE)
    h.fill_random(host, src, 5)
    want = h.page_bytes(host, src)
    dsts = [host.alloc(n * PAGE) for _ in range(3)]
    bad: list[str] = []

    def work(t: int) -> None:
        try:
            for r in range(rounds):
                # pages 0..n/2 of every thread's set are the same keys and bytes (shared)
                lo = t * n
                keys = [f"{(0 if i < n // 2 else t + 1):032x}{r:016x}{i:016x}"
                        for i in range(n)]
                idx = src[lo * PAGE:(lo + n) * PAGE] if t == 0 else torch.cat(
                    [src[:n // 2 * PAGE], src[(lo + n // 2) * PAGE:(lo + n) * PAGE]])
                if not all(backend.batch_set_v1(keys, idx)):
                    bad.append(f"t{t} r{r}: set failed")
                hits = backend.batch_exists(keys)
                got = backend.batch_get_v1(keys[:hits], dsts[t][:hits * PAGE])
                read = h.page_bytes(host, dsts[t][:hits * PAGE])
                expect = [want[i] if i < n // 2 else want[lo + i] for i in range(n)]
                for i, ok in enumerate(got):
                    if ok and read[i] != expect[i]:
                        bad.append(f"t{t} r{r} page {i}: wrong bytes")
        except Exception as err:
            bad.append(f"t{t}: {err!r}")

    pool = [threading.Thread(target=work, args=(t,)) for t in range(3)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    stats = backend.stats()
    backend.close()
    return {"bad": bad, "errors": stats["backend"]["errors"],
            "get_hit_pages": stats["backend"]["get_hit_pages"],
            "dram_evictions": stats["pool"]["dram"]["evictions"]}


def two_instances(args: dict[str, Any]) -> dict[str, Any]:
    """Two host pools, each with its own embedded pool, sharing one storage node."""
    cluster = {"nodes": [args["node"]]}
    out: dict[str, Any] = {}
    dev = h.device_pool(1024, PAGE, LAYERS, HEADS, DIM)
    a_host, b_host = h.host_pool(dev, "page_first"), h.host_pool(dev, "page_first")
    a = h.create_backend("dynamic", a_host, {**h.DYNAMIC, "config": pool_config(
        args["cache_dir"] + "/a", cluster=cluster)})
    b = h.create_backend("dynamic", b_host, {**h.DYNAMIC, "config": pool_config(
        args["cache_dir"] + "/b", cluster=cluster)})
    n = 5
    src = a_host.alloc(n * PAGE)
    h.fill_random(a_host, src, 7)
    keys = keys_for(n, salt=3)
    out["set_a"] = a.batch_set_v1(keys, src)
    out["flushed"] = a.flush(30)  # the cluster's write-behind reached the node
    out["exists_b"] = b.batch_exists(keys)
    dst = b_host.alloc(n * PAGE)
    out["get_b"] = b.batch_get_v1(keys, dst)
    out["equal"] = h.page_bytes(b_host, dst) == h.page_bytes(a_host, src)
    out["b_pool"] = b.stats()["pool"]["pool"]
    a.close()
    b.close()
    return out


def attached_ranks(args: dict[str, Any]) -> dict[str, Any]:
    """SGLang's two-rank layout (tp_size 2) attached to one host pool (``socket``), then a
    second instance's rank 0 attached to the same host pool."""
    extra = {**h.DYNAMIC, "config": pool_config(args["cache_dir"],
                                                host={"socket": args["socket"]})}
    dev = h.device_pool(1024, PAGE, LAYERS, HEADS, DIM)
    hosts = [h.host_pool(dev, "page_first") for _ in range(3)]
    ranks = [h.create_backend("dynamic", hosts[r], extra, tp_rank=r, tp_size=2)
             for r in range(2)]
    n = 5
    keys = keys_for(n, salt=5)  # SGLang names a page the same on every rank
    written = []
    out: dict[str, Any] = {"attached": [type(b.pool).__name__ for b in ranks]}
    for r, backend in enumerate(ranks):
        src = hosts[r].alloc(n * PAGE)
        h.fill_random(hosts[r], src, 20 + r)
        written.append(h.page_bytes(hosts[r], src))
        out[f"set_{r}"] = backend.batch_set_v1(keys, src)
    for r, backend in enumerate(ranks):  # each rank reads its own pages back
        dst = hosts[r].alloc(n * PAGE)
        out[f"get_{r}"] = backend.batch_get_v1(keys, dst)
        out[f"equal_{r}"] = h.page_bytes(hosts[r], dst) == written[r]
    other = h.create_backend("dynamic", hosts[2], extra, tp_rank=0, tp_size=2)
    out["exists_other"] = other.batch_exists(keys)
    dst = hosts[2].alloc(n * PAGE)
    out["get_other"] = other.batch_get_v1(keys, dst)
    out["other_equal_rank0"] = h.page_bytes(hosts[2], dst) == written[0]
    out["saved"] = [b.stats()["pool"]["attached"]["saves"]["save_stored"] for b in ranks]
    for backend in (*ranks, other):
        backend.close()
    return out


def controller(args: dict[str, Any]) -> dict[str, Any]:
    """SGLang's real HiCacheController: write-back of host pages to the backend, then
    a prefetch of the same tokens into fresh host memory, driven as the scheduler drives it.
    With ``fault`` set, SGLang's fault injector wraps the backend (set in the environment)."""
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    model = Path(args["cache_dir"]) / "model"  # only its config is read
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    publish(ServerArgs(model_path=str(model), device="cpu"), role="scheduler",
            ranks=SpawnRanks(world_rank=0))
    dev = h.device_pool(2048, PAGE, LAYERS, HEADS, DIM)
    host = h.host_pool(dev, args["layout"], ratio=4.0)
    alloc = PagedTokenToKVPoolAllocator(2048, PAGE, torch.bfloat16, "cpu", dev, False)
    extra = {**h.DYNAMIC, "config": pool_config(args["cache_dir"])}
    ctl = HiCacheController(alloc, host, PAGE, None, threading.Event(), io_backend="direct",
                            storage_backend="dynamic", model_name="test-model",
                            storage_backend_extra_config=extra, prefetch_threshold=PAGE)
    out: dict[str, Any] = {"backend": type(ctl.storage_backend).__name__}
    rounds = int(args.get("rounds", 1))
    pages = int(args.get("pages", 20))
    hits, correct, wrong, escaped = [], 0, 0, []
    for r in range(rounds):
        try:
            tokens = [int(t) for t in torch.randint(0, 30000, (pages * PAGE,),
                                                    generator=torch.Generator().manual_seed(r))]
            # KV the device pool backed up into host memory (the device-to-host copy itself
            # needs an accelerator stream in this release, so the pages are filled in place)
            host_idx = host.alloc(pages * PAGE)
            assert host_idx is not None
            h.fill_random(host, host_idx, 100 + r)
            want = h.page_bytes(host, host_idx)
            hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
            op_id = ctl.write_storage(host_idx, tokens, hash_value=hashes)
            done = ctl.ack_backup_queue.get(timeout=60)
            assert done.id == op_id
            # a new request with the same prompt: prefetch from storage (scheduler's part)
            op = ctl.prefetch(f"req{r}", tokens)
            op = ctl.prefetch_hit_queue.get(timeout=60)
            got = op.storage_hit_count // PAGE
            if got:
                op.host_indices = ctl.alloc_prefetch_host_buffers(op, got * PAGE)
                ctl.prefetch_buffer.put(op)
                completed = 0
                while True:
                    pack = ctl.ack_prefetch_queue.get(timeout=60)
                    if pack.completed_tokens is not None:
                        completed = max(completed, pack.completed_tokens)
                    if pack.completed_req:
                        break
                loaded = completed // PAGE
                fetched = h.page_bytes(host, op.host_indices[:loaded * PAGE])
                for a_page, b_page in zip(fetched, want, strict=False):
                    correct += a_page == b_page
                    wrong += a_page != b_page
                hits.append(loaded)
            else:
                hits.append(0)
        except Exception as err:  # an exception escaping SGLang's threads or the backend
            escaped.append(repr(err))
    out.update(hits=hits, pages=pages, correct_pages=correct, wrong_pages=wrong,
               escaped=escaped, backend_errors=_backend_stats(ctl))
    ctl.detach_storage_backend()
    return out


def _backend_stats(ctl: Any) -> Any:
    backend = getattr(ctl.storage_backend, "_backend", ctl.storage_backend)
    return backend.stats()["backend"]["errors"]


SCENARIOS = {"roundtrip": roundtrip, "two_instances": two_instances, "controller": controller,
             "threads": threads, "attached_ranks": attached_ranks}

if __name__ == "__main__":
    if sys.argv[1] == "batch":
        for name, scenario_args in json.loads(sys.argv[2]):
            print("RESULT " + json.dumps(SCENARIOS[name](scenario_args)), flush=True)
    else:
        print("RESULT " + json.dumps(SCENARIOS[sys.argv[1]](json.loads(sys.argv[2]))))
