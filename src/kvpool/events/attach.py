"""Wiring a publisher to a pool's tiers (the DRAM arena is ``CPU``, the SSD log ``DISK``),
and the publisher's metrics."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvpool.events.sink import MEDIUM_CPU, MEDIUM_DISK
from kvpool.metrics.families import Families

if TYPE_CHECKING:
    from kvpool.config import EventsConfig
    from kvpool.events.publisher import EventPublisher
    from kvpool.pool import KVPool

log = logging.getLogger(__name__)


def start_events(pool: KVPool, node: str | None, host: str,
                 key_scope: str = "", advertise: str | None = None) -> EventPublisher | None:
    """Start a publisher for ``pool`` (settings from its config's ``events`` section) and
    attach it to the pool's DRAM and SSD tiers; its metrics join ``pool.metrics``. ``node``:
    who holds the chunks (None: this host's name); ``key_scope``: how the tiers' keys relate
    to chunk keys (``KVEventBatch.key_scope``: a storage node's are "namespace");
    ``advertise``: the host ``/events`` names when ``host`` is a wildcard. Returns None,
    with one warning, when pyzmq or msgspec is not installed. Raises zmq.ZMQError when a
    port cannot be bound."""
    publisher = open_publisher(pool.config.events, node, host, key_scope, advertise)
    if publisher is not None:
        attach(pool, publisher)
    pool.metrics.register(EventsCollector(publisher))
    return publisher


def open_publisher(cfg: EventsConfig, node: str | None, host: str,
                   key_scope: str = "", advertise: str | None = None) -> EventPublisher | None:
    """A publisher with ``cfg``'s settings bound on ``host``, attached to nothing yet (one
    publisher may serve several pools: a host pool's tenants). None, with one warning,
    when pyzmq or msgspec is not installed. Raises zmq.ZMQError when a port cannot be
    bound."""
    try:
        from kvpool.events.publisher import EventPublisher, PublisherSettings
    except ImportError as exc:
        log.warning("kv events off: %s (pip install 'kvpool[server]')", exc,
                    extra={"event": "events_unavailable"})
        return None
    settings = PublisherSettings(host, cfg.port, cfg.replay_port, cfg.topic, cfg.queue_events,
                                 cfg.replay_batches, cfg.batch_interval_s,
                                 key_scope=key_scope, advertise=advertise)
    return EventPublisher(settings, node or socket.gethostname())


def bind_error(cfg: EventsConfig, exc: BaseException) -> str:
    """The one line ``kvpool serve`` and ``kvpool host`` exit with when the publisher's
    ports cannot be bound."""
    return (f"events.port={cfg.port}, events.replay_port={cfg.replay_port}: cannot publish "
            f"KV events: {exc}")


def attach(pool: KVPool, publisher: EventPublisher | None,
           tenant: str | None = None) -> None:
    """Point the pool's DRAM tier and SSD engine at ``publisher`` (None detaches), their
    events marked with ``tenant`` (a host pool's tenant pools; None: not marked). The
    cluster tier publishes nothing: REMOTE is a query-answer medium only (docs/routing.md)."""
    from kvpool.tiers.dram import DramTier
    from kvpool.tiers.ssd import SsdTier
    for tier in pool.tiers():
        if isinstance(tier, DramTier):
            tier.events = publisher.sink(MEDIUM_CPU, tenant) if publisher is not None else None
        elif isinstance(tier, SsdTier):
            tier.engine.attach_events(publisher.sink(MEDIUM_DISK, tenant)
                                      if publisher is not None else None)


class EventsCollector(Collector):
    """kvpool_events_*: zeros when no publisher runs (the families are always there)."""

    def __init__(self, publisher: EventPublisher | None) -> None:
        self._publisher = publisher

    def collect(self) -> Iterator[Metric]:
        fam = Families()
        pub = self._publisher
        published = dict(pub.published) if pub is not None else {}
        for medium in sorted({MEDIUM_CPU, MEDIUM_DISK, *published}):
            fam.add("kvpool_events_published_total", published.get(medium, 0), medium)
        fam.add("kvpool_events_batches_total", pub.batches if pub is not None else 0)
        fam.add("kvpool_events_dropped_total", pub.dropped if pub is not None else 0)
        fam.add("kvpool_events_replays_total", pub.replays if pub is not None else 0)
        return iter(fam)
