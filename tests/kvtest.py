"""Shared test helpers: small namespaces and configs that keep every test on tmp_path.

Imported as ``from kvtest import ...`` (several test folders have their own conftest.py, so
``conftest`` is not a usable module name)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvpool.config import Config, config_from_dict
from kvpool.keys import KVLayout, Namespace

CHUNK = 64 * 1024


def byte_namespace(chunk_bytes: int = CHUNK, model: str = "test-model",
                   salt: str = "") -> Namespace:
    """A namespace whose chunks are ``chunk_bytes`` opaque bytes."""
    return Namespace(model, KVLayout("uint8", 1, 1, chunk_bytes, 1, kv_factor=1),
                     tenant_salt=salt)


def payload_for(key: bytes, nbytes: int = CHUNK) -> np.ndarray:
    """Deterministic bytes derived from the key, so any reader can check what it got."""
    seed = int.from_bytes(key[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def small_config(tmp_path: Path, **sections: dict[str, Any]) -> Config:
    data: dict[str, Any] = {
        "cache_dir": str(tmp_path / "cache"),
        "dram": {"capacity": "1MiB", "slab_size": "256KiB"},
        "ssd": {"capacity": "4MiB", "segment_size": "1MiB"},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return config_from_dict(data)




def child_env() -> dict[str, str]:
    """The environment for a child Python process that must import this checkout's kvpool."""
    import os

    import kvpool

    env = dict(os.environ)
    src = str(Path(kvpool.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


def read_acks(ack: Path) -> list[bytes]:
    """Complete lines (hex keys) of a child's acknowledgement log; a torn last line is cut off
    the file (that put was acknowledged to nobody) so the next child appends after a clean
    line."""
    import os

    if not ack.exists():
        return []
    raw = ack.read_bytes()
    cut = raw.rfind(b"\n") + 1
    if cut != len(raw):
        os.truncate(ack, cut)
    return [bytes.fromhex(line.decode()) for line in raw[:cut].splitlines()]
