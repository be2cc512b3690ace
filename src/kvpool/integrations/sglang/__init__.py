"""SGLang integration: ``KVPoolHiCacheStorage``, a HiCache L3 storage backend (see
``backend.py``; needs sglang 0.5.23, the pinned version of ``scripts/sglang-env.sh``).

Loaded by SGLang's ``dynamic`` backend factory::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "kvpool", "module_path": "kvpool.integrations.sglang",
      "class_name": "KVPoolHiCacheStorage", "interface_v1": 1, "config_path": "kvpool.yaml"}'

Importing this package imports nothing of SGLang; the class is loaded on first access, and
the submodules other than ``backend`` import neither SGLang nor torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool.integrations.sglang.backend import KVPoolHiCacheStorage

__all__ = ["KVPoolHiCacheStorage"]


def __getattr__(name: str) -> Any:
    # Lazy, so ``kvpool.integrations.sglang.settings`` and friends import without SGLang.
    if name == "KVPoolHiCacheStorage":
        from kvpool.integrations.sglang.backend import KVPoolHiCacheStorage

        return KVPoolHiCacheStorage
    raise AttributeError(name)
