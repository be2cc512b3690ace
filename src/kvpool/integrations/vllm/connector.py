"""``KVPoolConnector``: kvpool as a vLLM v1 KV connector (vLLM 0.32.0, pinned).

Load it with::

    KVTransferConfig(kv_connector="KVPoolConnector",
                     kv_connector_module_path="kvpool.integrations.vllm",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"config_path": "kvpool.yaml"})

vLLM builds one instance per role. This class only dispatches: ``scheduler.py`` (lookups and
per-step plans), ``worker.py`` (page copies, owns the embedded pool), ``lookup.py`` (why and
how the scheduler asks the worker), ``layout.py`` (namespace, payload layout),
``settings.py`` (extra config keys).

Failure contract: configuration errors raise at engine start (ConfigError, ValueError).
At run time pool faults never raise into vLLM: a failed load is reported through
``get_block_ids_with_load_errors`` (use ``kv_load_failure_policy="recompute"``; with vLLM's
default "fail" such a request fails), a failed save is dropped and counted.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvpool.errors import ConfigError
from kvpool.integrations.vllm.layout import EngineIdentity, namespace_from_canonical
from kvpool.integrations.vllm.metadata import KVPoolConnectorMetadata, KVPoolHandshake
from kvpool.integrations.vllm.scheduler import SchedulerSide
from kvpool.integrations.vllm.settings import parse_settings
from kvpool.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvpool.integrations.vllm")


def _identity(vllm_config: Any, model_id: str | None) -> EngineIdentity:
    mc = vllm_config.model_config
    served = mc.served_model_name
    if isinstance(served, list | tuple):
        served = served[0] if served else None
    backend = "unknown"
    ctx = getattr(vllm_config.compilation_config, "static_forward_context", None) or {}
    for layer in ctx.values():
        impl = getattr(layer, "attn_backend", None)
        if impl is not None:
            backend = str(impl.get_name())
            break
    return EngineIdentity(
        model=model_id or str(served or mc.model), revision=str(mc.revision or "main"),
        num_kv_heads=int(mc.get_num_kv_heads(vllm_config.parallel_config)),
        head_size=int(mc.get_head_size()), block_size=int(vllm_config.cache_config.block_size),
        backend=backend, vllm_version=str(vllm.__version__))


class KVPoolConnector(KVConnectorBase_V1):  # type: ignore[misc]
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ConfigError("KVPoolConnector does not support pipeline parallelism yet")
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) > 1:
            raise ConfigError("KVPoolConnector supports models with one KV cache group (plain "
                              f"attention); this model has {len(groups)}")
        self._settings = parse_settings(
            self._kv_transfer_config.kv_connector_extra_config,
            int(vllm_config.cache_config.block_size))
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(self._settings)
        else:
            from vllm.distributed.parallel_state import (
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )
            self._worker = WorkerSide(
                self._settings, _identity(vllm_config, self._settings.model_id),
                get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size(),
                num_blocks=getattr(kv_cache_config, "num_blocks", None))

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is only a future miss

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def get_handshake_metadata(self) -> KVPoolHandshake | None:
        w = self._worker
        if w is None or w.ns is None or w.server is None:
            return None
        return KVPoolHandshake(namespace=w.ns.canonical(), lookup_address=w.server.address)

    def _meta(self) -> KVPoolConnectorMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, KVPoolConnectorMetadata) else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._meta()
        if self._worker is not None and meta is not None and meta.loads:
            self._worker.start_load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        meta = self._meta()
        if self._worker is not None and meta is not None and meta.stores:
            self._worker.save_layer(layer_name, kv_layer, meta.stores)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.end_step()
            meta = self._meta()
            if meta is not None and meta.releases:
                self._worker.release(meta.releases)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._sched is not None:
            self._sched.close()

    # ------------------------------------------------------------ scheduler side
    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        assert self._sched is not None
        workers = []
        for rank in sorted(metadata):
            hs = metadata[rank]
            if not isinstance(hs, KVPoolHandshake):
                continue
            workers.append((namespace_from_canonical(hs.namespace), hs.lookup_address))
        if len(workers) != len(metadata):
            log.warning("kvpool: %d of %d workers sent no handshake; lookups disabled",
                        len(metadata) - len(workers), len(metadata))
            workers = []
        self._sched.set_workers(workers)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """vLLM hands the scheduler's block pool over once built; offload_threshold reads
        its KV usage (BlockPool.get_usage), nothing else of it."""
        if self._sched is not None:
            self._sched.bind_usage(gpu_block_pool.get_usage)

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._sched is not None
        so = scheduler_output
        computed: dict[str, int] = {}
        tables: dict[str, list[int]] = {}
        for new in so.scheduled_new_reqs:
            computed[new.req_id] = new.num_computed_tokens
            tables[new.req_id] = list(new.block_ids[0]) if new.block_ids else []
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            computed[req_id] = cached.num_computed_tokens[i]
        state = so.kv_connector_block_state

        def block_table(req_id: str) -> list[int]:
            if state is not None:
                return list(state.resolve_block_ids(req_id)[0])
            return tables.get(req_id, [])

        loads, stores = self._sched.build(dict(so.num_scheduled_tokens), computed, block_table)
        return KVPoolConnectorMetadata(loads=loads, stores=stores,
                                       releases=self._sched.take_releases())

    def update_connector_output(self, connector_output: Any) -> None:
        if self._sched is not None and connector_output.invalid_block_ids:
            self._sched.load_failed(set(connector_output.invalid_block_ids))

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._sched is not None:
            self._sched.finished(request.request_id)
        return False, None  # saves copy pages during the step: blocks can be freed now
