"""Scheduler side: lookups, per-request plans and the per-step metadata (no vLLM imports).

Keys are computed here from the prompt and each worker rank's namespace (received in the
handshake), so the metadata carries pool keys and block ids only. With tensor parallelism the
usable prefix is the minimum of the ranks' answers (each rank stores its own shard).

With ``offload_threshold`` > 0 a request is saved only when the engine's KV usage (from the
block pool vLLM binds, ``bind_usage``) is at least the threshold as its first chunk completes;
the decision holds for the whole request. Without a bound block pool every request is saved.

Failure contract: nothing here raises into the scheduler for pool faults. Before the
handshake, for requests kvpool cannot key (LoRA, multimodal inputs, prompt embeddings) and
when a worker does not answer, a lookup is a miss and nothing is stored.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from kvpool.integrations.retention import merged_retention
from kvpool.integrations.vllm.lookup import LookupClient
from kvpool.integrations.vllm.plan import ReqTransfer, RequestPlan
from kvpool.integrations.vllm.settings import ConnectorSettings
from kvpool.keys import Namespace

log = logging.getLogger("kvpool.integrations.vllm")

_MEMO_LIMIT = 4096  # requests whose keys are remembered between lookups (LRU)


def cacheable_prompt(request: Any) -> list[int] | None:
    """The prompt token ids if kvpool can key this request, else None."""
    tokens = getattr(request, "prompt_token_ids", None)
    if tokens is None or getattr(request, "lora_request", None) is not None \
            or getattr(request, "mm_features", None):
        return None
    return list(tokens)


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings) -> None:
        self.settings = settings
        self.namespaces: list[Namespace] = []
        self.clients: list[LookupClient] = []
        self._memo: OrderedDict[str, tuple[list[tuple[bytes, ...]], int]] = OrderedDict()
        self._plans: dict[str, RequestPlan] = {}
        self._usage: Callable[[], float] | None = None
        self._saving: dict[str, bool] = {}  # per request: the offload_threshold decision
        #: Prompt chunks not saved because KV usage was below offload_threshold.
        self.skipped_chunks = 0
        self._warned_unbound = False
        #: Per request: its saves' retention (the engine's under kv_transfer_params').
        self._retention: dict[str, dict[str, Any] | None] = {}
        self._releases: list[tuple[str, bool]] = []

    def bind_usage(self, usage: Callable[[], float]) -> None:
        """``usage()`` -> the engine's KV cache usage in [0, 1] (vLLM's BlockPool.get_usage),
        read when offload_threshold decides whether a request is saved."""
        self._usage = usage

    def _keeps(self, req_id: str, chunks: int) -> bool:
        """Whether this request's stores go ahead (decided at its first, then kept)."""
        threshold = self.settings.offload_threshold
        if threshold <= 0:
            return True
        saving = self._saving.get(req_id)
        if saving is None:
            if self._usage is None:
                if not self._warned_unbound:
                    self._warned_unbound = True
                    log.warning("kvpool: offload_threshold=%g, but vLLM bound no block pool "
                                "to the connector; every request is saved", threshold)
                saving = True
            else:
                saving = self._usage() >= threshold
            self._saving[req_id] = saving
        if not saving:
            self.skipped_chunks += chunks
        return saving

    def set_workers(self, workers: Sequence[tuple[Namespace, str]]) -> None:
        """(namespace, lookup address) per tensor-parallel rank, rank order."""
        for c in self.clients:
            c.close()
        self.namespaces = [ns for ns, _ in workers]
        self.clients = [LookupClient(addr, self.settings.lookup_timeout_s) for _, addr in workers]

    def _keys(self, req_id: str, tokens: list[int]) -> list[tuple[bytes, ...]]:
        memo = self._memo.get(req_id)
        if memo is not None and memo[1] == len(tokens):
            self._memo.move_to_end(req_id)
            return memo[0]
        per_rank = [ns.chunk_keys(tokens) for ns in self.namespaces]
        keys = list(zip(*per_rank, strict=True)) if per_rank else []
        self._memo[req_id] = (keys, len(tokens))
        while len(self._memo) > _MEMO_LIMIT:
            self._memo.popitem(last=False)
        return keys

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` the pool can provide: whole chunks, never the
        whole prompt (vLLM must compute at least one token). Reads only."""
        tokens = cacheable_prompt(request)
        if tokens is None or not self.clients:
            return 0
        chunk = self.settings.chunk_tokens
        usable = (len(tokens) - 1) // chunk
        if usable * chunk <= num_computed_tokens:
            return 0
        keys = self._keys(request.request_id, tokens)[:usable]
        hits = min(c.lookup([k[r] for k in keys]) for r, c in enumerate(self.clients))
        return max(0, hits * chunk - num_computed_tokens)

    def _note_retention(self, request: Any) -> None:
        """Read the request's ``kv_transfer_params``: ``retention`` (a mapping, see
        docs/retention.md) over the engine's, and ``release_session`` (with
        ``release_delete``) to end a session after this step's saves."""
        params = getattr(request, "kv_transfer_params", None)
        params = params if isinstance(params, Mapping) else {}
        asked = params.get("retention")
        if asked is not None and not isinstance(asked, Mapping):
            log.warning("kvpool: kv_transfer_params.retention must be a mapping, got %r", asked)
            asked = None
        self._retention[request.request_id] = merged_retention(self.settings.retention, asked)
        session = params.get("release_session")
        if isinstance(session, str) and session:
            self._releases.append((session, params.get("release_delete") is True))

    def take_releases(self) -> list[tuple[str, bool]]:
        """The sessions requests asked to end since the last call."""
        releases, self._releases = self._releases, []
        return releases

    def after_alloc(self, request: Any, num_external_tokens: int) -> None:
        self._note_retention(request)
        tokens = cacheable_prompt(request)
        if tokens is None or not self.namespaces:
            return
        plan = self._plans.get(request.request_id)
        if plan is None:
            plan = RequestPlan(request.request_id, self._keys(request.request_id, tokens),
                               len(tokens), self.settings.chunk_tokens,
                               self.settings.block_size)
            self._plans[request.request_id] = plan
        plan.pending_load_tokens = num_external_tokens

    def build(self, scheduled: dict[str, int], computed_before: dict[str, int],
              block_table: Any) -> tuple[list[ReqTransfer], list[ReqTransfer]]:
        """Loads and stores of one step. ``block_table(req_id)`` returns the request's block
        ids (first KV cache group)."""
        loads: list[ReqTransfer] = []
        stores: list[ReqTransfer] = []
        for req_id, n in scheduled.items():
            plan = self._plans.get(req_id)
            if plan is None or req_id not in computed_before:
                continue
            load, store = plan.step(computed_before[req_id], n, block_table(req_id))
            if load is not None:
                loads.append(load)
            if store is not None and self._keeps(req_id, len(store.chunks)):
                retention = self._retention.get(req_id)
                stores.append(replace(store, retention=retention) if retention else store)
        return loads, stores

    def load_failed(self, invalid_blocks: set[int]) -> None:
        for plan in self._plans.values():
            if plan.load_failed(invalid_blocks):
                log.info("kvpool: load of request %s failed; vLLM recomputes it", plan.req_id)

    def finished(self, req_id: str) -> None:
        self._plans.pop(req_id, None)
        self._memo.pop(req_id, None)
        self._saving.pop(req_id, None)
        self._retention.pop(req_id, None)

    def close(self) -> None:
        for c in self.clients:
            c.close()
