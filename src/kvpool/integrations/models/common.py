"""Helpers shared by the offline model loaders: errors, KV geometry, offline mode, atomic publish.

A build goes to a temporary sibling directory (:func:`_make_tmp`) and is renamed into place
(:func:`_publish`); a marker file written last (:func:`_read_marker`) tells a finished build
from an interrupted one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvpool.errors import KVPoolError

# One logger for the whole package, named as before the split into modules.
log = logging.getLogger("kvpool.integrations.models")

# Version of the marker files that the loaders write last into a finished build.
_FORMAT = 1
_STALE_TMP_S = 3600.0


class ModelUnavailableError(KVPoolError, RuntimeError):
    """A model's files are not installed here; the message says what to install."""


class ModelMismatchError(KVPoolError, RuntimeError):
    """A loaded model is not the one expected (architecture, layer count, KV heads, ...)."""


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

