"""Namespaces and chained, content-addressed chunk keys (DESIGN.md section 2).

A chunk key is a 16-byte xxh3-128 digest:
``key_i = H(namespace_id || key_{i-1} || token_ids_i as little-endian uint32)`` with
``key_{-1}`` = 16 zero bytes, so a key names the whole prefix up to and including its chunk.
Only fixed, cross-language hashing of canonical bytes is used: keys are equal across processes,
machines and Python versions (never ``hash()``, never pickle).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any, cast

import numpy as np
import xxhash

from kvpool.errors import ArgumentError

KEY_BYTES = 16
_ZERO_KEY = bytes(KEY_BYTES)
#: Up to this many keys, split_key_bytes slices (crossover measured on the 2-core VM: ~8).
_SLICED_KEYS = 8


def split_key_bytes(raw: bytes, offset: int = 0) -> list[bytes]:
    """The keys packed back to back in ``raw[offset:]``, whose length the caller checked is
    a multiple of KEY_BYTES. Past a few keys one numpy pass instead of a Python slice per
    key (a 512-key EXISTS: ~9 us, not ~50; a host pool's 64-key pin: 1.7 us, not 6.6)."""
    if len(raw) - offset <= _SLICED_KEYS * KEY_BYTES:
        return [raw[o:o + KEY_BYTES] for o in range(offset, len(raw), KEY_BYTES)]
    return cast(list[bytes], np.frombuffer(raw, f"V{KEY_BYTES}", offset=offset).tolist())

#: Bytes per element of the dtypes engines use for KV. Unknown dtypes are rejected.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


def canonical_json(obj: Any) -> bytes:
    """UTF-8 JSON with sorted keys and no whitespace: the only bytes kvpool ever hashes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True)
class KVLayout:
    """Shape of one chunk's KV payload. Part of the namespace: a different layout never hits.

    ``engine_layout`` is a free-form tag for engine-specific page layouts (attention backend,
    block size); ``kv_factor`` is 2 for separate K and V, 1 for MLA-style latent caches.

    Raises ArgumentError (a ValueError and a TypeError) on construction if a field has the
    wrong type (an int field given 2.5, True or "2"), a dimension is not positive or the dtype
    is unknown.
    """

    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    chunk_tokens: int = 256
    kv_factor: int = 2
    tp_rank: int = 0
    tp_size: int = 1
    engine_layout: str = ""

    def __post_init__(self) -> None:
        _check_fields(self, str_fields=("dtype", "engine_layout"),
                      int_fields=("num_layers", "num_kv_heads", "head_dim", "chunk_tokens",
                                  "kv_factor", "tp_rank", "tp_size"))
        if self.dtype not in DTYPE_BYTES:
            raise ArgumentError(f"unknown KV dtype {self.dtype!r}; known: "
                                f"{sorted(DTYPE_BYTES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "chunk_tokens", "kv_factor",
                     "tp_size"):
            if getattr(self, name) <= 0:
                raise ArgumentError(f"KVLayout.{name} must be positive, got "
                                    f"{getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ArgumentError(f"KVLayout.tp_rank {self.tp_rank} not in [0, {self.tp_size})")

    @property
    def bytes_per_token(self) -> int:
        return (self.num_layers * self.kv_factor * self.num_kv_heads * self.head_dim
                * DTYPE_BYTES[self.dtype])

    @property
    def chunk_bytes(self) -> int:
        """Exact payload size of one full chunk (layer-major: layer 0's K and V, then layer 1)."""
        return self.bytes_per_token * self.chunk_tokens

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's slice inside a chunk payload."""
        return self.chunk_bytes // self.num_layers


@dataclass(frozen=True)
class Namespace:
    """Model + revision + KV layout + tenant salt. Equal fields give an equal ``id`` everywhere.

    Tenants are isolated by ``tenant_salt``: equal prompts of two tenants give different keys.
    Raises ArgumentError on construction if a field has the wrong type.
    """

    model: str
    layout: KVLayout
    revision: str = "main"
    tenant_salt: str = ""

    def __post_init__(self) -> None:
        _check_fields(self, str_fields=("model", "revision", "tenant_salt"), int_fields=())
        if not isinstance(self.layout, KVLayout):
            raise ArgumentError(f"Namespace.layout must be a KVLayout, got "
                                f"{type(self.layout).__name__}")

    def canonical(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "revision": self.revision,
            "layout": asdict(self.layout),
            "tenant_salt": self.tenant_salt,
        }

    @classmethod
    def from_canonical(cls, data: Any) -> Namespace:
        """Rebuild a namespace from ``canonical()`` output (as sent over the wire).

        Raises ValueError for anything that is not exactly that shape or has bad values."""
        if not isinstance(data, dict) or set(data) != {"model", "revision", "layout",
                                                       "tenant_salt"}:
            raise ValueError("namespace must be an object with model, revision, layout, "
                             "tenant_salt")
        layout = data["layout"]
        fields = set(KVLayout.__dataclass_fields__)
        if not isinstance(layout, dict) or set(layout) != fields:
            raise ValueError(f"namespace layout must have exactly the fields {sorted(fields)}")
        for name in ("model", "revision", "tenant_salt"):
            if not isinstance(data[name], str):
                raise ValueError(f"namespace {name} must be a string")
        for name, value in layout.items():
            want = str if name in ("dtype", "engine_layout") else int
            if not isinstance(value, want) or isinstance(value, bool):
                raise ValueError(f"namespace layout.{name} must be {want.__name__}")
        return cls(data["model"], KVLayout(**layout), data["revision"], data["tenant_salt"])

    @property
    def tenant(self) -> str:
        """The tenant a namespace belongs to: its tenant_salt up to the first ':'."""
        return self.tenant_salt.split(":", 1)[0]

    @cached_property
    def id(self) -> bytes:
        """16-byte namespace id: xxh3-128 of the canonical JSON of all fields."""
        return bytes(xxhash.xxh3_128_digest(canonical_json(self.canonical())))

    @cached_property
    def layout_id(self) -> int:
        """64-bit id of the layout alone, written into every record header."""
        return int(xxhash.xxh3_64_intdigest(canonical_json(asdict(self.layout))))

    @cached_property
    def chunk_bytes(self) -> int:
        return self.layout.chunk_bytes

    @property
    def chunk_tokens(self) -> int:
        return self.layout.chunk_tokens

    def chunk_keys(self, token_ids: Sequence[int] | np.ndarray) -> list[bytes]:
        return chunk_keys(self.id, token_ids, self.layout.chunk_tokens)


def _check_fields(obj: object, str_fields: Sequence[str], int_fields: Sequence[str]) -> None:
    """Dataclasses do not check annotations: a float head count or a None model would hash
    into a namespace id no engine can reproduce. Raises ArgumentError naming the field."""
    cls = type(obj).__name__
    for name in str_fields:
        value = getattr(obj, name)
        if not isinstance(value, str):
            raise ArgumentError(f"{cls}.{name} must be a str, got {value!r}")
    for name in int_fields:
        value = getattr(obj, name)
        if not isinstance(value, int | np.integer) or isinstance(value, bool):
            raise ArgumentError(f"{cls}.{name} must be an int, got {value!r}")
        if not isinstance(value, int):  # numpy ints: canonical JSON needs a plain int
            object.__setattr__(obj, name, int(value))


def _as_uint32_le(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype="<u4")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF:
        raise ValueError("token ids must lie in [0, 2**32)")
    return np.ascontiguousarray(arr, dtype="<u4")


def chunk_keys(namespace_id: bytes, token_ids: Sequence[int] | np.ndarray,
               chunk_tokens: int) -> list[bytes]:
    """Chained 16-byte keys of every *full* chunk of ``token_ids``; a trailing partial chunk
    gets no key.

    Raises ValueError for a namespace id that is not 16 bytes, a non-positive chunk size or
    token ids outside uint32.
    """
    if len(namespace_id) != KEY_BYTES:
        raise ValueError(f"namespace id must be {KEY_BYTES} bytes, got {len(namespace_id)}")
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    tokens = _as_uint32_le(token_ids)
    raw = tokens.data.cast("B")
    step = chunk_tokens * 4
    keys: list[bytes] = []
    prev = _ZERO_KEY
    for start in range(0, (tokens.size // chunk_tokens) * step, step):
        h = xxhash.xxh3_128()
        h.update(namespace_id)
        h.update(prev)
        h.update(raw[start:start + step])
        prev = h.digest()
        keys.append(prev)
    return keys


def next_chunk_key(namespace_id: bytes, prev: bytes | None,
                   token_ids: Sequence[int] | np.ndarray) -> bytes:
    """The chained key after ``prev`` (None: the first chunk) for one chunk's ``token_ids``:
    ``chunk_keys`` one step at a time, for a consumer that learns chunks one by one (a
    router rebuilding keys from an engine's KV events). Raises ValueError as ``chunk_keys``."""
    if len(namespace_id) != KEY_BYTES:
        raise ValueError(f"namespace id must be {KEY_BYTES} bytes, got {len(namespace_id)}")
    h = xxhash.xxh3_128()
    h.update(namespace_id)
    h.update(_ZERO_KEY if prev is None else prev)
    h.update(_as_uint32_le(token_ids).data.cast("B"))
    return h.digest()
