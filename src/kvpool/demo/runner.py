"""Replays workloads through a Hugging Face model in every mode and records what happened.

Each mode gets a fresh store in a scratch directory and a fresh copy of the workloads (chat
prompts contain the model's own earlier replies, so each mode feeds back its own). Per request
the runner records time to first token (TTFT: lookup + load + suffix prefill + first argmax),
total time, generated tokens, prompt tokens restored from the store and hits per tier. Saves
and the write-behind finish between requests, outside the timed region, as they would overlap
other requests' compute in a server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from kvpool.demo.stores import close_store, make_cold, make_store, tier_hits
from kvpool.demo.workloads import Request
from kvpool.integrations.hf import PrefixCache, namespace_for


class RequestStream(Protocol):
    """A workload's requests in order; ``reply`` feeds the model's answer back (chat)."""

    def __iter__(self) -> Iterator[Request]: ...

    def peek(self) -> list[Request]: ...

    def reply(self, request: Request, tokens: list[int]) -> None: ...


@dataclass
class RequestResult:
    mode: str
    workload: str
    name: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    total_s: float
    tokens: list[int]
    hits: dict[str, int] = field(default_factory=dict)
    load_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Settings:
    chunk_tokens: int = 256
    dram_bytes: int = 2 << 30
    ssd_bytes: int = 8 << 30
    eos_token_id: int | None = None


@torch.inference_mode()
def warm_up(model: Any) -> None:
    """One untimed forward so one-time costs (thread pools, kernels) hit no mode."""
    model(input_ids=torch.zeros((1, 8), dtype=torch.long), use_cache=True, logits_to_keep=1)


def run_mode(model: Any, mode: str, streams: Sequence[RequestStream], workdir: Path,
             settings: Settings, model_id: str,
             on_request: Callable[[RequestResult], None] | None = None) -> list[RequestResult]:
    """Replay every stream in order through one mode; the store is closed afterwards."""
    ns = namespace_for(model, settings.chunk_tokens, model_id=model_id)
    store = make_store(mode, workdir, ns.chunk_bytes, settings.dram_bytes, settings.ssd_bytes)
    cache = PrefixCache(model, store, settings.chunk_tokens, model_id=model_id)
    results: list[RequestResult] = []
    try:
        if store is not None:  # engines preallocate KV memory at start-up; so does the demo
            cache.reserve(max(len(r.prompt) for s in streams for r in s.peek()))
        for stream in streams:
            for request in stream:
                make_cold(store)
                before = tier_hits(store)
                gen = cache.generate(request.prompt, request.max_new_tokens,
                                     settings.eos_token_id)
                after = tier_hits(store)
                cache.flush()
                stream.reply(request, gen.tokens)
                result = RequestResult(
                    mode=mode, workload=request.workload, name=request.name,
                    prompt_tokens=len(request.prompt), cached_tokens=gen.prefill.cached_tokens,
                    ttft_s=gen.ttft_s, total_s=gen.total_s, tokens=gen.tokens,
                    hits={k: after[k] - before.get(k, 0) for k in after},
                    load_s=gen.prefill.timings.get("load_s", 0.0))
                results.append(result)
                if on_request is not None:
                    on_request(result)
    finally:
        cache.close()
        close_store(store)
    return results
