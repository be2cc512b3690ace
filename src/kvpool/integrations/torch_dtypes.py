"""The KV dtype name kvpool stores (a key of ``kvpool.keys.DTYPE_BYTES``) for a torch dtype:
one map for every engine integration."""

from __future__ import annotations

import torch

TORCH_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.uint8: "uint8", torch.int8: "int8",
    torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The stored name of ``dtype``. Raises ValueError for a dtype kvpool does not store."""
    try:
        return TORCH_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {dtype}") from None
