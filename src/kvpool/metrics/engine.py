"""The engine metrics (catalogue.py, component "engine") of an integration: what the engine
asked kvpool for and got, in tokens, and its time to first token where the integration
sees it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypedDict

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvpool.metrics.families import Families
from kvpool.metrics.recorder import LabeledLatency


class EngineCounts(TypedDict):
    #: Prompt tokens (whole chunks) looked up and found / not found.
    lookup_hit_tokens: int
    lookup_miss_tokens: int
    #: Tokens loaded from kvpool instead of computed.
    prefill_tokens_saved: int
    #: Tokens saved into kvpool (chunks accepted).
    stored_tokens: int


class EngineCollector(Collector):
    """Exports ``counts()`` (the integration's own counters, read at scrape time) and, if
    given, ``ttft`` (observations labelled with the engine name) for engine ``engine``."""

    def __init__(self, engine: str, counts: Callable[[], EngineCounts],
                 ttft: LabeledLatency | None = None) -> None:
        self.engine = engine
        self._counts = counts
        self._ttft = ttft

    def collect(self) -> Iterator[Metric]:
        counts = self._counts()
        out = Families()
        e = self.engine
        out.add("kvpool_engine_lookup_tokens_total", counts["lookup_hit_tokens"], e, "hit")
        out.add("kvpool_engine_lookup_tokens_total", counts["lookup_miss_tokens"], e, "miss")
        out.add("kvpool_engine_prefill_tokens_saved_total", counts["prefill_tokens_saved"], e)
        out.add("kvpool_engine_stored_tokens_total", counts["stored_tokens"], e)
        if self._ttft is not None:
            out.add_histogram("kvpool_engine_ttft_seconds", self._ttft.snapshot())
        return iter(out)
