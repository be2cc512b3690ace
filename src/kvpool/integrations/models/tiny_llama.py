"""A tiny random-weight Llama with a locally trained tokenizer, built and loaded offline.

:func:`build_tiny_llama` saves random weights from a fixed seed plus a byte-level BPE tokenizer
trained in a second on a corpus generated in code. Same arguments, same bytes on disk.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from kvpool.integrations.models.common import (
    _FORMAT,
    _force_offline,
    _make_tmp,
    _publish,
    _read_marker,
    log,
)

# Written last into a finished directory; a directory without it is not a usable build.
_TINY_MARKER = "kvpool-tiny-llama.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

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
