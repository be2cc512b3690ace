"""Fetch one Prometheus ``/metrics`` endpoint over HTTP and index its samples.

A scrape never raises for the endpoint's sake: a refused or timed-out connection, an HTTP
error or a body that is not the text exposition format gives a :class:`Scrape` whose
``error`` says why (the endpoint shows as down). Only a malformed endpoint *argument* raises
(ValueError, from :func:`endpoint_url`).
"""

from __future__ import annotations

import http.client
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from kvpool.cluster.membership import parse_address

__all__ = ["LabelKey", "Scrape", "endpoint_url", "scrape", "scrape_all"]

LabelKey = tuple[tuple[str, str], ...]
"""A series' labels, sorted by name: the key of its value in :attr:`Scrape.samples`."""

_SAMPLE_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"),
                    "summary": ("_count", "_sum")}
_MAX_BODY = 64 << 20  # a kvpool endpoint exposes a few hundred series; this is a sanity cap


def endpoint_url(endpoint: str) -> str:
    """The URL to scrape: ``host:port`` means ``http://host:port/metrics``; a URL without a
    path gets ``/metrics``; any other URL is used as given.

    Raises ValueError for a bare address that is not ``host:port`` or a URL that is not http(s).
    """
    text = endpoint.strip()
    if "://" not in text:
        address, slash, path = text.partition("/")
        parse_address(address)  # ValueError names the address
        return f"http://{address}/{path if slash and path else 'metrics'}"
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"endpoint {endpoint!r}: expected host:port or an http(s) URL")
    if parts.path in ("", "/"):
        parts = parts._replace(path="/metrics")
    return urllib.parse.urlunsplit(parts)


@dataclass(frozen=True)
class Scrape:
    """One endpoint at one moment: ``samples[name][labels] = value`` (sample names as
    exposed: ``kvpool_read_bytes_total``, ``kvpool_op_seconds_bucket``, ...), or ``error`` when the
    endpoint did not answer with metrics. ``at`` is ``time.monotonic()`` when the answer came.
    """

    url: str
    at: float
    samples: Mapping[str, Mapping[LabelKey, float]] = field(default_factory=dict)
    error: str | None = None

    @property
    def up(self) -> bool:
        return self.error is None

    def has(self, name: str) -> bool:
        """Whether the endpoint exposes ``name`` (a sample name)."""
        return name in self.samples

    def total(self, name: str, **match: str) -> float | None:
        """Sum of the series of ``name`` whose labels include ``match``; None if no series
        matches (the endpoint is down, lacks the metric, or has no such series: a gauge of a
        tier or queue it does not have)."""
        want = match.items()
        values = [v for labels, v in self.samples.get(name, {}).items()
                  if want <= dict(labels).items()]
        return float(sum(values)) if values else None

    def label_values(self, name: str, label: str) -> set[str]:
        """Every value ``label`` takes among the series of ``name``."""
        return {v for labels in self.samples.get(name, {}) for k, v in labels if k == label}

    def series(self, name: str) -> Mapping[LabelKey, float]:
        """Every series of ``name`` (empty if absent)."""
        return self.samples.get(name, {})


def parse(text: str) -> dict[str, dict[LabelKey, float]]:
    """Index a text exposition by sample name and sorted labels.

    Raises ValueError if ``text`` is not the Prometheus text format.
    """
    samples: dict[str, dict[LabelKey, float]] = {}
    for family in text_string_to_metric_families(text):
        # A labelled metric none of whose children is used yet exposes no sample, only its
        # TYPE line: list its names anyway, so it reads as 0 rather than absent.
        for suffix in _SAMPLE_SUFFIXES.get(family.type, ("",)):
            samples.setdefault(family.name + suffix, {})
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = \
                float(sample.value)
    return samples


def scrape(url: str, timeout_s: float) -> Scrape:
    """GET ``url`` (already an :func:`endpoint_url`) and parse it; never raises for what the
    endpoint does: any failure gives a down :class:`Scrape` with the reason."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = response.read(_MAX_BODY + 1)
        if len(body) > _MAX_BODY:
            raise ValueError(f"answer larger than {_MAX_BODY} bytes")
        samples = parse(body.decode("utf-8"))
    except (OSError, http.client.HTTPException, ValueError) as exc:
        # OSError covers refused / reset / timed out and urllib's URLError / HTTPError;
        # ValueError a body that is not UTF-8 or not the exposition format.
        return Scrape(url, time.monotonic(), error=_reason(exc))
    return Scrape(url, time.monotonic(), samples)


def scrape_all(urls: Sequence[str], timeout_s: float) -> list[Scrape]:
    """:func:`scrape` every URL in parallel (a slow endpoint delays none of the others beyond
    ``timeout_s``), in the order given."""
    if not urls:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(urls)),
                            thread_name_prefix="kvpool-monitor") as pool:
        return list(pool.map(lambda u: scrape(u, timeout_s), urls))


def _reason(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    reason = getattr(exc, "reason", None)  # URLError wraps the socket error
    if isinstance(reason, BaseException):
        exc = reason
    if isinstance(exc, OSError) and exc.strerror:  # "Connection refused", not "[Errno 111] ..."
        return exc.strerror
    text = str(reason if isinstance(reason, str) else exc) or type(exc).__name__
    return text.splitlines()[0][:200]
