"""Prefix reuse on a real (small, random-weight) Llama: restored KV must give the logits and
tokens of a full prefill, in every store; a broken chunk must cost a recompute, never output."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf extra (torch, transformers) is not installed")
transformers = pytest.importorskip("transformers")

from kvtest import small_config  # noqa: E402

from kvpool import KVPool  # noqa: E402
from kvpool.integrations.hf import PrefixCache, namespace_for  # noqa: E402
from kvpool.keys import Namespace  # noqa: E402
from kvpool.peers.file_pool import FilePerChunkPool  # noqa: E402
from kvpool.saves import LoadHandle, SaveTicket  # noqa: E402
from kvpool.tiers.ssd import SsdTier  # noqa: E402

CHUNK_TOKENS = 32
MiB = 1 << 20


def tiny_llama(seed: int = 0, dtype: Any = None) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=2048)
    cfg._name_or_path = f"tiny-llama-seed{seed}"
    model = transformers.LlamaForCausalLM(cfg).eval()
    return model.to(dtype) if dtype is not None else model


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_llama()


def prompt(n: int, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(0, 512, n).tolist()


def pool_at(path: Path, **sections: dict[str, Any]) -> KVPool:
    return KVPool(small_config(path, **{"dram": {"capacity": "8MiB", "slab_size": "1MiB"},
                                        "ssd": {"capacity": "16MiB", "segment_size": "2MiB"},
                                        **sections}))


def test_namespace_from_model_config(model: Any) -> None:
    ns = namespace_for(model, CHUNK_TOKENS)
    assert (ns.layout.num_layers, ns.layout.num_kv_heads, ns.layout.head_dim) == (3, 2, 16)
    assert ns.layout.dtype == "float32"
    assert ns.chunk_bytes == 3 * 2 * 2 * 16 * CHUNK_TOKENS * 4


@pytest.mark.parametrize("shared", [200, 130])  # full hit of 6 chunks / partial hit of 4
def test_restored_prefix_logits_equal_full_prefill(model: Any, tmp_path: Path,
                                                   shared: int) -> None:
    base = PrefixCache(model, None, CHUNK_TOKENS)
    with pool_at(tmp_path) as pool:
        cached = PrefixCache(model, pool, CHUNK_TOKENS)
        first = prompt(200)
        cached.prefill(first)
        cached.flush()
        second = first[:shared] + prompt(70, seed=2)
        hit = cached.prefill(second)
        assert hit.cached_tokens == shared // CHUNK_TOKENS * CHUNK_TOKENS
        full = base.prefill(second)
        assert full.cached_tokens == 0
        assert torch.max(torch.abs(hit.logits - full.logits)).item() <= 1e-5
        cached.close()


def generate_all(model: Any, store: Any, prompts: Sequence[list[int]]) -> list[list[int]]:
    pc = PrefixCache(model, store, CHUNK_TOKENS)
    outs = []
    for p in prompts:
        outs.append(pc.generate(p, max_new_tokens=6).tokens)
        pc.flush()
    pc.close()
    return outs


def test_greedy_outputs_identical_in_every_mode(model: Any, tmp_path: Path) -> None:
    system = prompt(150, seed=7)
    prompts = [system + prompt(40, seed=s) for s in range(3)] + [system]
    expected = generate_all(model, None, prompts)
    with pool_at(tmp_path / "dram") as pool:
        assert generate_all(model, pool, prompts) == expected
        assert pool.stats()["pool"]["dram_hits"] > 0
    with pool_at(tmp_path / "ssd", dram={"capacity": 0}) as pool:
        assert generate_all(model, pool, prompts) == expected
        assert pool.stats()["ssd"]["hits"] > 0
    fpc = FilePerChunkPool(tmp_path / "fpc")
    assert generate_all(model, fpc, prompts) == expected
    assert fpc.stats()["file_per_chunk"]["hits"] > 0


def test_other_model_dtype_or_tenant_never_hits(model: Any, tmp_path: Path) -> None:
    ids = prompt(200)
    with pool_at(tmp_path) as pool:
        owner = PrefixCache(model, pool, CHUNK_TOKENS, tenant_salt="a")
        owner.prefill(ids)
        owner.flush()
        assert owner.prefill(ids).cached_tokens > 0
        others = [PrefixCache(model, pool, CHUNK_TOKENS, tenant_salt="b"),
                  PrefixCache(tiny_llama(seed=1), pool, CHUNK_TOKENS, tenant_salt="a"),
                  PrefixCache(tiny_llama(dtype=torch.bfloat16), pool, CHUNK_TOKENS,
                              tenant_salt="a")]
        assert len({o.ns.id for o in others} | {owner.ns.id}) == 4
        for other in others:
            assert other.prefill(ids).cached_tokens == 0
            other.close()
        owner.close()


def _segment_offset_of(tmp_path: Path, pool: KVPool, ns: Namespace, key: bytes) -> Path:
    eng = next(t.engine for t in pool._tiers if isinstance(t, SsdTier))
    loc = eng._index.get(key)
    assert loc is not None
    return Path(f"{pool.config.ssd_path()}/seg-{loc.segment:05d}.kvs"), loc.block * 4096


def test_corrupt_chunk_on_ssd_is_a_miss_and_output_is_unchanged(model: Any,
                                                                 tmp_path: Path) -> None:
    ids = prompt(200)
    expected = generate_all(model, None, [ids])[0]
    with pool_at(tmp_path, dram={"capacity": 0}) as pool:
        pc = PrefixCache(model, pool, CHUNK_TOKENS)
        pc.generate(ids, 6)
        pc.flush()
        keys = pc.ns.chunk_keys(ids)
        seg, offset = _segment_offset_of(tmp_path, pool, pc.ns, keys[2])
        with open(seg, "r+b") as f:  # flip one bit inside chunk 2's payload
            f.seek(offset + 4096 + 1000)
            byte = f.read(1)[0]
            f.seek(offset + 4096 + 1000)
            f.write(bytes([byte ^ 0x04]))
        gen = pc.generate(ids, 6)
        assert gen.prefill.cached_tokens == 2 * CHUNK_TOKENS  # chunks 0 and 1 only
        assert gen.tokens == expected
        assert pool.stats()["ssd"]["checksum_failures"] == 1
        pc.close()


class StoreWrapper:
    """Delegates every store call to a real pool; subclasses override the ones they break."""

    def __init__(self, inner: KVPool) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class WrongKV(StoreWrapper):
    """A store that hands back every chunk with its bytes perturbed: the negative control."""

    def open_load(self, ns: Namespace, keys: Sequence[bytes]) -> LoadHandle:
        inner = self.inner.open_load(ns, keys)
        wrong = [np.frombuffer(v, np.float32)[::-1].copy() if v is not None else None
                 for v in inner.sources]  # plausible numbers, wrong places
        inner.release()
        return LoadHandle([memoryview(w).cast("B").toreadonly() if w is not None else None
                           for w in wrong], [], [], lambda b: None)


def test_negative_control_wrong_kv_changes_the_logits(model: Any, tmp_path: Path) -> None:
    ids = prompt(200)
    full = PrefixCache(model, None, CHUNK_TOKENS).prefill(ids)
    with pool_at(tmp_path) as pool:
        writer = PrefixCache(model, pool, CHUNK_TOKENS)
        writer.prefill(ids)
        writer.flush()
        wrong = PrefixCache(model, WrongKV(pool), CHUNK_TOKENS).prefill(ids)
        assert wrong.cached_tokens == 6 * CHUNK_TOKENS
        assert torch.max(torch.abs(wrong.logits - full.logits)).item() > 1e-2
        writer.close()


def tiny_mistral(sliding_window: int) -> Any:
    """Every layer sliding-window attention (DynamicSlidingWindowLayer in the cache)."""
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=2048,
                                     sliding_window=sliding_window)
    return transformers.MistralForCausalLM(cfg).eval()


def test_sliding_window_layers_get_their_length_restored(tmp_path: Path) -> None:
    model = tiny_mistral(sliding_window=1024)  # wider than the prompt: every token is kept
    ids = prompt(200)
    full = PrefixCache(model, None, CHUNK_TOKENS).prefill(ids)
    with pool_at(tmp_path) as pool:
        pc = PrefixCache(model, pool, CHUNK_TOKENS)
        pc.prefill(ids)
        pc.flush()
        hit = pc.prefill(ids)
        assert hit.cached_tokens == 6 * CHUNK_TOKENS
        layer = hit.cache.layers[0]
        assert layer.is_sliding and layer.cumulative_length == len(ids)
        assert torch.max(torch.abs(hit.logits - full.logits)).item() <= 1e-5
        pc.close()


def test_window_narrower_than_the_prompt_is_not_saved(tmp_path: Path) -> None:
    """Such a layer no longer holds the early tokens' K/V, so no chunk can be stored whole:
    saves are dropped (counted) and the output is the model's own."""
    model = tiny_mistral(sliding_window=64)
    ids = prompt(200)
    expected = generate_all(model, None, [ids, ids])
    with pool_at(tmp_path) as pool:
        pc = PrefixCache(model, pool, CHUNK_TOKENS)
        outs = [pc.generate(ids, 6).tokens for _ in range(2)]
        pc.flush()
        assert outs == expected
        assert pc.saved_chunks == 0 and pc.dropped_saves == 2 * 6
        assert pool.lookup(pc.ns, pc.ns.chunk_keys(ids)) == 0
        pc.close()


class FailingFills(StoreWrapper):
    """A store whose saves fail while the slots are being filled (the pool's save thread
    sees an error): saving must not reach the caller, and the reserved slots come back."""

    def save(self, ns: Namespace, keys: Sequence[bytes], fill: Any, *,
             defer: bool = False) -> SaveTicket:
        def failing(i: int, view: memoryview) -> None:
            raise OSError(28, "No space left on device")
        return self.inner.save(ns, keys, failing, defer=defer)


def test_failing_saves_are_dropped_and_counted(model: Any, tmp_path: Path) -> None:
    ids = prompt(200)
    expected = generate_all(model, None, [ids])[0]
    with pool_at(tmp_path) as pool:
        pc = PrefixCache(model, FailingFills(pool), CHUNK_TOKENS)
        assert pc.generate(ids, 6).tokens == expected
        pc.flush()
        assert pc.saved_chunks == 0 and pc.dropped_saves == 6
        assert pool.stats()["saves"]["save_dropped_fill"] == 6
        assert pool.stats()["dram"]["used_bytes"] == 0
        pc.close()


class SlowFills(StoreWrapper):
    """A store whose saves wait for ``release`` before they fill their slots: the pool's
    save thread is behind the next request. (The Event only controls when the save lands.)"""

    def __init__(self, inner: KVPool) -> None:
        super().__init__(inner)
        self.release = threading.Event()

    def save(self, ns: Namespace, keys: Sequence[bytes], fill: Any, *,
             defer: bool = False) -> SaveTicket:
        def slow(i: int, view: memoryview) -> None:
            self.release.wait(10)
            fill(i, view)
        return self.inner.save(ns, keys, slow, defer=defer)


@pytest.mark.parametrize("wait_s", [5.0, 0.05])
def test_the_next_request_waits_for_a_running_save_of_its_prefix(model: Any, tmp_path: Path,
                                                                 wait_s: float) -> None:
    """Read-your-writes (the pool's): a prompt right after the one that produced its prefix
    hits it even though the save is still running (its load waits, bounded by
    pool.save_commit_wait_s); past the bound it recomputes, and its output is the model's
    own either way."""
    ids = prompt(200)
    expected = generate_all(model, None, [ids, ids])
    with pool_at(tmp_path, pool={"save_commit_wait_s": wait_s}) as pool:
        store = SlowFills(pool)
        pc = PrefixCache(model, store, CHUNK_TOKENS)
        first = pc.generate(ids, 6)
        timer = threading.Timer(0.5, store.release.set)
        timer.start()
        second = pc.generate(ids, 6)
        assert [first.tokens, second.tokens] == expected
        expected_cached = 6 * CHUNK_TOKENS if wait_s > 0.5 else 0
        assert second.prefill.cached_tokens == expected_cached
        timer.join()
        pc.close()


class SaverPriority(StoreWrapper):
    """Records the nice value of the thread that fills the slots (the pool's save thread)."""

    def __init__(self, inner: KVPool) -> None:
        super().__init__(inner)
        self.nice: list[int] = []

    def save(self, ns: Namespace, keys: Sequence[bytes], fill: Any, *,
             defer: bool = False) -> SaveTicket:
        def noted(i: int, view: memoryview) -> None:
            self.nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            fill(i, view)
        return self.inner.save(ns, keys, noted, defer=defer)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
@pytest.mark.parametrize("nice", [10, 0])
def test_the_saver_yields_to_the_engine(model: Any, tmp_path: Path, nice: int) -> None:
    """The gather runs on the pool's save thread at pool.background_nice above the engine's
    thread (0: the same); every chunk is still saved, and the next request restores them."""
    ids = prompt(200)
    engine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with pool_at(tmp_path, pool={"background_nice": nice}) as pool:
        store = SaverPriority(pool)
        pc = PrefixCache(model, store, CHUNK_TOKENS)
        first = pc.generate(ids, 6)
        pc.flush()
        assert pc.saved_chunks == 6 and pc.dropped_saves == 0
        assert store.nice and set(store.nice) == {min(19, engine + nice)}
        second = pc.generate(ids, 6)
        assert second.prefill.cached_tokens == 6 * CHUNK_TOKENS
        assert second.tokens == first.tokens
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == engine
        pc.close()


def test_old_saver_settings_are_accepted_with_a_deprecation(model: Any) -> None:
    with pytest.warns(DeprecationWarning, match="pool.save_commit_wait_s"):
        PrefixCache(model, None, CHUNK_TOKENS, save_wait_s=1.0)
    with pytest.warns(DeprecationWarning, match="pool.background_nice"):
        PrefixCache(model, None, CHUNK_TOKENS, saver_nice=5)


def test_engine_metrics_count_tokens_and_ttft_through_the_pool_registry(
        model: Any, tmp_path: Path) -> None:
    from metrics_support import scrape, value
    ids = prompt(200)  # 6 whole chunks of 32 tokens, and 8 tokens that are never saved
    with pool_at(tmp_path) as pool:
        pc = PrefixCache(model, pool, CHUNK_TOKENS)
        pc.generate(ids, max_new_tokens=2)  # nothing cached: 6 chunks looked up, all miss
        pc.flush()
        pc.generate(ids, max_new_tokens=2)  # hit
        pc.flush()
        s = scrape(pool.metrics)
        usable = (len(ids) - 1) // CHUNK_TOKENS * CHUNK_TOKENS  # tokens a lookup may find
        hit = value(s, "kvpool_engine_lookup_tokens_total", engine="hf", result="hit")
        miss = value(s, "kvpool_engine_lookup_tokens_total", engine="hf", result="miss")
        assert (hit, miss) == (usable, usable)  # first request all miss, second all hit
        assert value(s, "kvpool_engine_prefill_tokens_saved_total", engine="hf") == usable
        saved = len(ids) // CHUNK_TOKENS * CHUNK_TOKENS
        assert value(s, "kvpool_engine_stored_tokens_total", engine="hf") == saved
        assert value(s, "kvpool_engine_ttft_seconds_count", engine="hf") == 2
        # the pool's own view of the same hit
        assert value(s, "kvpool_hit_tokens_total", tier="dram") == usable
        pc.close()
        assert not any(name.startswith("kvpool_engine") for name, _ in scrape(pool.metrics))


def test_retention_of_the_engine_and_of_one_call(model: Any, tmp_path: Path) -> None:
    """The engine's retention (ephemeral: never on the SSD) and a call's own over it (a
    pinned session), released through the pool."""
    with pool_at(tmp_path, pool={"ssd_write": "through"}) as pool:
        pc = PrefixCache(model, pool, CHUNK_TOKENS, retention={"priority": "ephemeral"})
        fleeting, kept = prompt(100, seed=3), prompt(100, seed=4)
        pc.prefill(fleeting)
        pc.prefill(kept, retention={"priority": "pin", "session": "conv"})
        pc.flush()
        ssd = pool._stack.ssd
        assert ssd is not None
        fleeting_keys, kept_keys = pc.ns.chunk_keys(fleeting), pc.ns.chunk_keys(kept)
        assert all(pool.contains_many(pc.ns, fleeting_keys + kept_keys))
        assert not any(ssd.contains_many(fleeting_keys, pc.ns.id))
        assert all(ssd.contains_many(kept_keys, pc.ns.id))
        assert pool.stats()["retention"]["pinned_bytes"] == 3 * pc.ns.chunk_bytes
        assert pool.release("conv") == 3
        assert pool.stats()["retention"]["pinned_bytes"] == 0
        pc.close()
    with pytest.raises(ValueError, match="priority"):
        PrefixCache(model, None, CHUNK_TOKENS, retention={"priority": "urgent"})
