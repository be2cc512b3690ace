"""SGLang's real host pool and backend factory, built without the engine (tests, benchmarks).

Runs inside the SGLang venv (``scripts/sglang-env.sh``): a CPU ``MHATokenToKVPool`` (the device
pool the host pool mirrors), an ``MHATokenToKVPoolHost`` of the chosen layout (not pinned:
no CUDA here), and a backend created through ``StorageBackendFactory`` exactly as SGLang's
cache controller creates it. Failure contract: SGLang's own errors propagate.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory

#: The dynamic loader's keys for this backend.
DYNAMIC = {"backend_name": "kvpool", "module_path": "kvpool.integrations.sglang",
           "class_name": "KVPoolHiCacheStorage", "interface_v1": 1}


def device_pool(tokens: int, page_size: int, layers: int, heads: int, head_dim: int,
                dtype: torch.dtype = torch.bfloat16) -> MHATokenToKVPool:
    return MHATokenToKVPool(size=tokens, page_size=page_size, dtype=dtype, head_num=heads,
                            head_dim=head_dim, layer_num=layers, device="cpu",
                            enable_memory_saver=False)


def host_pool(device: MHATokenToKVPool, layout: str, ratio: float = 2.0) -> MHATokenToKVPoolHost:
    return MHATokenToKVPoolHost(device._mha_buffer_info(), ratio, 0, device.page_size, layout,
                                pin_memory=False, device="cpu",
                                device_capacity_tokens=device.size, start_layer=0,
                                end_layer=device.layer_num)


def storage_config(extra: dict[str, Any] | None, model: str = "test-model", tp_rank: int = 0,
                   tp_size: int = 1, page_first: bool = False) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
        is_page_first_layout=page_first, model_name=model, extra_config=extra)


def create_backend(name: str, host: MHATokenToKVPoolHost, extra: dict[str, Any] | None,
                   model: str = "test-model", tp_rank: int = 0,
                   tp_size: int = 1) -> HiCacheStorage:
    """A backend as the controller attaches it: factory, then ``register_mem_pool_host``.
    ``name`` "dynamic" with ``extra`` holding ``DYNAMIC`` creates kvpool's."""
    config = storage_config(extra, model, tp_rank, tp_size,
                            page_first=host.layout != "layer_first")
    backend: HiCacheStorage = StorageBackendFactory.create_backend(name, config, host)
    backend.register_mem_pool_host(host)
    return backend


def fill_random(host: MHATokenToKVPoolHost, indices: torch.Tensor, seed: int) -> None:
    """Random bytes into the host pool's pages at ``indices`` (whole pages)."""
    gen = torch.Generator().manual_seed(seed)
    for start in range(0, indices.numel(), host.page_size):
        page = host.get_data_page(int(indices[start]), flat=True)
        fresh = torch.randint(0, 256, (page.numel() * page.element_size(),),
                              dtype=torch.uint8, generator=gen)
        host.set_from_flat_data_page(int(indices[start]), fresh.view(host.dtype))


def page_bytes(host: MHATokenToKVPoolHost, indices: torch.Tensor) -> list[bytes]:
    """Each page's flat bytes, for byte-for-byte comparisons."""
    return [host.get_data_page(int(indices[s]), flat=True).contiguous().view(torch.uint8)
            .numpy().tobytes() for s in range(0, indices.numel(), host.page_size)]
