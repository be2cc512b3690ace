"""An engine's own view of its load, from its Prometheus ``/metrics`` (vLLM's
``vllm:num_requests_running`` and ``vllm:num_requests_waiting``).

The proxy counts only the requests it sent; traffic that reaches an engine another way (a
second router, a client that bypasses it) is invisible to those counts. The router scrapes
each engine every ``engine_metrics_interval_s`` and takes, per engine, the larger of its own
in-flight count and the engine's running + waiting requests, while the scrape is fresh
(``stale_after`` intervals). A scrape that fails or finds neither metric (an engine started
with ``--disable-log-stats`` exports none) leaves only the proxy's counts: never an error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"


def parse_engine_load(text: str) -> tuple[float, float] | None:
    """(running, waiting) requests summed over label sets (one per model / data-parallel
    rank), or None when the text has neither metric. Raises ValueError for text that is not
    Prometheus exposition format."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in (RUNNING, WAITING):
            found[family.name] = found.get(family.name, 0.0) + sum(
                s.value for s in family.samples if s.name == family.name)
    if not found:
        return None
    return found.get(RUNNING, 0.0), found.get(WAITING, 0.0)


@dataclass
class EngineLoad:
    """The last scrape of one engine."""

    running: float = 0.0
    waiting: float = 0.0
    at: float = 0.0  # time.monotonic() of the scrape, 0: never
    failures: int = 0

    def update(self, load: tuple[float, float] | None) -> None:
        """A scrape's result; None (failed, or no such metric) makes it stale at once."""
        if load is None:
            self.failures += 1
            self.at = 0.0
            return
        self.running, self.waiting = load
        self.at = time.monotonic()

    def requests(self, max_age_s: float) -> float:
        """Running + waiting requests, or 0 if the last good scrape is older than
        ``max_age_s`` (or there was none)."""
        if not self.at or time.monotonic() - self.at > max_age_s:
            return 0.0
        return self.running + self.waiting
