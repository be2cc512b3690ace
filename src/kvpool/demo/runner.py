"""Replays workloads through a Hugging Face model in every mode and records what happened.

Each mode gets a fresh store in a scratch directory and a fresh copy of the workloads (chat
prompts contain the model's own earlier replies, so each mode feeds back its own). Modes run
together request by request (``run_modes``) where their TTFTs are divided. Per request
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

from kvpool.demo.stores import close_store, dropped_saves, make_cold, make_store, tier_hits
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
    forward_s: float = 0.0  # the prefill's model forward, inside ttft_s
    #: Chunks of this request the store or the integration dropped instead of saving.
    dropped_saves: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Settings:
    chunk_tokens: int = 256
    dram_bytes: int = 2 << 30
    ssd_bytes: int = 8 << 30
    eos_token_id: int | None = None
    #: Serve the kvpool modes' metrics on this port (kvpool) and the next (kvpool-ssd).
    metrics_port: int | None = None


@torch.inference_mode()
def warm_up(model: Any, tokens: int = 8) -> None:
    """One untimed forward over ``tokens`` tokens so one-time costs (thread pools, kernels, the
    allocator growing to a request's activations) hit no mode: give it a request's length."""
    model(input_ids=torch.zeros((1, max(1, tokens)), dtype=torch.long), use_cache=True,
          logits_to_keep=1)


class ModeRun:
    """One mode's store, PrefixCache and copy of the workloads, open until ``close``. Raises
    what ``make_store`` raises (nothing stays open then)."""

    def __init__(self, model: Any, mode: str, streams: Sequence[RequestStream], workdir: Path,
                 settings: Settings, model_id: str) -> None:
        self.mode, self.streams, self.settings = mode, streams, settings
        ns = namespace_for(model, settings.chunk_tokens, model_id=model_id)
        longest = max(len(r.prompt) for s in streams for r in s.peek())
        self.store = make_store(mode, workdir, ns.chunk_bytes, settings.dram_bytes,
                                settings.ssd_bytes, settings.metrics_port,
                                request_bytes=-(-longest // settings.chunk_tokens) * ns.chunk_bytes)
        try:
            self.cache = PrefixCache(model, self.store, settings.chunk_tokens, model_id=model_id)
            if self.store is not None:  # engines preallocate KV memory at start-up; so does
                self.cache.reserve(longest)
        except BaseException:
            close_store(self.store)
            raise

    def replay(self) -> Iterator[RequestResult]:
        """Replay every stream in order, one request per step."""
        store, cache = self.store, self.cache
        for stream in self.streams:
            for request in stream:
                make_cold(store)
                before = tier_hits(store)
                dropped_before = dropped_saves(store) + cache.dropped_saves
                gen = cache.generate(request.prompt, request.max_new_tokens,
                                     self.settings.eos_token_id)
                after = tier_hits(store)
                cache.flush()
                dropped = dropped_saves(store) + cache.dropped_saves - dropped_before
                stream.reply(request, gen.tokens)
                yield RequestResult(
                    mode=self.mode, workload=request.workload, name=request.name,
                    prompt_tokens=len(request.prompt), cached_tokens=gen.prefill.cached_tokens,
                    ttft_s=gen.ttft_s, total_s=gen.total_s, tokens=gen.tokens,
                    hits={k: after[k] - before.get(k, 0) for k in after},
                    load_s=gen.prefill.timings.get("load_s", 0.0),
                    forward_s=gen.prefill.timings.get("forward_s", 0.0),
                    dropped_saves=dropped)

    def close(self) -> None:
        try:
            self.cache.close()
        finally:
            close_store(self.store)


def run_modes(model: Any, modes: Sequence[str],
              make_streams: Callable[[], Sequence[RequestStream]], workdir: Path,
              settings: Settings, model_id: str,
              on_request: Callable[[RequestResult], None] | None = None) -> list[RequestResult]:
    """Replay the workloads through several modes at once, request by request: request k of
    every mode runs before request k+1 of any, and the mode that goes first rotates with k.
    Every store is open (and preallocated) before the first request. So a ratio of two modes
    divides TTFTs measured seconds apart, under the same load from the rest of the machine,
    not minutes apart. Each store is closed afterwards; the results are grouped by mode."""
    runs: list[ModeRun] = []
    try:
        for mode in modes:
            runs.append(ModeRun(model, mode, make_streams(), workdir, settings, model_id))
        steps = [run.replay() for run in runs]
        results: dict[str, list[RequestResult]] = {mode: [] for mode in modes}
        k = 0
        while steps:
            turn = k % len(steps)
            for step in steps[turn:] + steps[:turn]:
                result = next(step, None)
                if result is None:
                    steps.remove(step)
                    continue
                results[result.mode].append(result)
                if on_request is not None:
                    on_request(result)
            k += 1
        return [r for mode in modes for r in results[mode]]
    finally:
        for run in runs:
            run.close()
