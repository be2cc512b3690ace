"""``kvpool route``: an OpenAI-compatible HTTP proxy that sends each request to the engine
holding most of its prefix (:mod:`kvpool.route.policy`), on aiohttp.

Per request (``POST /v1/completions``, ``/v1/chat/completions``):

1. Token ids, from an engine's own ``/tokenize`` (vLLM's OpenAI server), within
   ``index_timeout_s``. On a timeout or an error the request goes to the least-loaded engine
   (reason ``index_timeout`` / ``index_error``): the router never waits on a slow index.
2. Per engine, the prompt's cached prefix by tier: its own prefix cache (its vLLM KV events,
   :class:`~kvpool.route.index.EngineIndex`), its host pool and the shared storage nodes
   (kvpool's KV events, keys of ``namespace_id`` in chunks of ``chunk_tokens``), and its load:
   requests in flight through this proxy and the prompt tokens still to prefill of those that
   have not yet returned a byte. Every publisher is followed by one
   :class:`~kvpool.events.consumer.EventConsumer` on a thread of its own (sequence numbers,
   incarnations, a gap replayed from the publisher's replay socket where one is given, else
   a reset); the indexes are read under a lock, never waiting on a publisher.
3. The policy names an engine; the body is forwarded unchanged and the answer streamed back
   as it comes (SSE passes through chunk by chunk). An engine that refuses the connection is
   marked down for ``dead_cooldown_s`` (its index reset: it comes back empty) and the
   request goes to the next choice; once an answer has started, an upstream failure ends the
   client's response (no retry: the output may be half sent).

``GET /metrics`` (Prometheus), ``GET /healthz``, ``GET /v1/models`` (from an engine). A body
that is not a JSON object is a 400; no engine alive is a 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kvpool.events.consumer import EventConsumer
from kvpool.events.schema import AllBlocksCleared, KVEventBatch
from kvpool.keys import chunk_keys
from kvpool.route.engine_load import EngineLoad, parse_engine_load
from kvpool.route.index import RESET_CLEARED, RESET_DEAD, EngineIndex, SourceStats
from kvpool.route.policy import (
    Candidate,
    LeastLoadedPolicy,
    NoEngineError,
    RoutingPolicy,
)

log = logging.getLogger(__name__)

REASON_INDEX_TIMEOUT = "index_timeout"
REASON_INDEX_ERROR = "index_error"
_FORWARD_HEADERS = ("Content-Type", "Authorization", "Accept")


@dataclass(frozen=True)
class EngineSpec:
    """One engine: its OpenAI server, its vLLM KV-event publisher (and that publisher's
    replay socket), its host pools' publishers (each with its replay socket or None)."""

    url: str
    events: str | None = None
    host_events: tuple[str, ...] = ()
    replay: str | None = None
    host_replays: tuple[str | None, ...] = ()


@dataclass(frozen=True)
class RouterSettings:
    engines: Sequence[EngineSpec]
    policy: RoutingPolicy
    storage_events: Sequence[str] = ()
    namespace_id: bytes | None = None  # kvpool's namespace of the pool's keys
    chunk_tokens: int = 256
    index_timeout_s: float = 0.5
    dead_cooldown_s: float = 5.0
    request_timeout_s: float = 600.0
    storage_replays: Sequence[str | None] = ()  # per storage_events entry, or none at all
    replay_timeout_s: float = 0.5  # how long a gap's replay may take (the index lock waits)
    #: how often each engine's /metrics is read for its own running + waiting counts
    #: (kvpool.route.engine_load); 0: never, the proxy's own counts only
    engine_metrics_interval_s: float = 1.0


@dataclass
class _Engine:
    name: str
    spec: EngineSpec
    index: EngineIndex = field(default_factory=EngineIndex)
    reported: EngineLoad = field(default_factory=EngineLoad)
    in_flight: int = 0
    pending_tokens: int = 0
    dead_until: float = 0.0

    @property
    def alive(self) -> bool:
        return time.monotonic() >= self.dead_until


class Router:
    """The proxy's state and handlers. ``start`` binds; ``close`` stops everything."""

    def __init__(self, settings: RouterSettings) -> None:
        if not settings.engines:
            raise ValueError("kvpool route needs at least one engine")
        self.settings = settings
        self.policy = settings.policy
        self._fallback = LeastLoadedPolicy()
        self.registry = CollectorRegistry()
        self._decisions = Counter("kvpool_route_decisions", "Requests routed, by reason.",
                                  ["reason"], registry=self.registry)
        self._resets = Counter("kvpool_route_index_resets", "Index resets, by source and "
                               "reason (gap, restart, cleared, dead).", ["source", "reason"],
                               registry=self.registry)
        self._in_flight = Gauge("kvpool_route_in_flight", "Requests in flight, per engine.",
                                ["engine"], registry=self.registry)
        self._pending = Gauge("kvpool_route_pending_prefill_tokens", "Prompt tokens still to "
                              "prefill of requests yet to answer, per engine.", ["engine"],
                              registry=self.registry)
        self._reported = Gauge("kvpool_route_engine_reported_requests", "Running + waiting "
                               "requests per engine from its own /metrics (last scrape).",
                               ["engine"], registry=self.registry)
        self._up = Gauge("kvpool_route_engine_up", "1 if the engine is taking requests.",
                         ["engine"], registry=self.registry)
        self._lag = Gauge("kvpool_route_index_lag_seconds", "Seconds since the last KV-event "
                          "batch applied, per source.", ["source"], registry=self.registry)
        self._delay = Gauge("kvpool_route_index_delay_seconds", "How late the last KV-event "
                            "batch arrived (applied minus the publisher's timestamp), per "
                            "source.", ["source"], registry=self.registry)
        self._blocks = Gauge("kvpool_route_index_blocks", "Blocks or chunks an index holds.",
                             ["source"], registry=self.registry)
        self.engines = [_Engine(f"engine{i}", spec) for i, spec in enumerate(settings.engines)]
        #: publisher endpoint -> (replay endpoint, the router's names for it)
        self._endpoints: dict[str, tuple[str | None, list[str]]] = {}
        self._engine_at: dict[str, _Engine] = {}
        for e in self.engines:
            if e.spec.events:
                self._follow(e.spec.events, e.spec.replay, e.name)
                self._engine_at[e.spec.events] = e
            replays = e.spec.host_replays or (None,) * len(e.spec.host_events)
            for j, (ep, rp) in enumerate(zip(e.spec.host_events, replays, strict=True)):
                self._follow(ep, rp, f"{e.name}-host{j}")
        storage_replays = settings.storage_replays or (None,) * len(settings.storage_events)
        for j, (ep, rp) in enumerate(zip(settings.storage_events, storage_replays,
                                         strict=True)):
            self._follow(ep, rp, f"storage{j}")
        self.sources = {n: SourceStats(n) for _, names in self._endpoints.values()
                        for n in names}
        #: guards the indexes and the consumer's state (the consumer thread writes them)
        self._lock = threading.Lock()
        self.consumer: EventConsumer | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._scraper: asyncio.Task[None] | None = None

    def _follow(self, endpoint: str, replay: str | None, name: str) -> None:
        old_replay, names = self._endpoints.setdefault(endpoint, (replay, []))
        names.append(name)
        if replay and not old_replay:
            self._endpoints[endpoint] = (replay, names)

    # ------------------------------------------------------------------ KV events

    def batch(self, node: str, source: str, seq: int, batch: KVEventBatch) -> None:
        """EventListener: one batch applied by the consumer (its thread, under the lock)."""
        engine = self._engine_at.get(source)
        cleared = (engine.index.apply(batch.events) if engine is not None
                   else any(isinstance(ev, AllBlocksCleared) for ev in batch.events))
        for name in self._endpoints[source][1]:
            self.sources[name].applied(batch.ts)
            if cleared:
                self._count_reset(name, RESET_CLEARED)

    def reset(self, node: str, source: str, reason: str) -> None:
        """EventListener: the consumer dropped a publisher's state (a gap it could not
        replay, a restart)."""
        engine = self._engine_at.get(source)
        if engine is not None:
            engine.index.clear()
        for name in self._endpoints[source][1]:
            self._count_reset(name, reason)

    def _count_reset(self, source: str, reason: str) -> None:
        stats = self.sources[source]
        stats.resets[reason] = stats.resets.get(reason, 0) + 1
        self._resets.labels(source, reason).inc()

    def _follow_events(self) -> None:
        """The consumer thread: apply what arrives, under the lock, until ``close``."""
        consumer = self.consumer
        assert consumer is not None
        while not self._stop.is_set():
            try:
                if consumer.wait(0.1):
                    with self._lock:
                        consumer.poll(0)
            except Exception:  # the thread must outlive a bad batch
                log.exception("kv events: the consumer failed; going on")
                time.sleep(0.1)

    def _pool_nodes(self, endpoints: Sequence[str]) -> list[str]:
        assert self.consumer is not None
        return [self.consumer.node_at[ep] for ep in endpoints if ep in self.consumer.node_at]

    # ------------------------------------------------------------------ engine metrics

    def load(self, e: _Engine) -> float:
        """Requests on ``e``: the proxy's own in-flight count, or the engine's running +
        waiting from its last fresh /metrics scrape where that is more."""
        interval = self.settings.engine_metrics_interval_s
        reported = e.reported.requests(3 * interval) if interval > 0 else 0.0
        return max(float(e.in_flight), reported)

    async def _scrape(self, e: _Engine) -> None:
        """One read of ``e``'s /metrics; a failure or a page without vLLM's gauges leaves
        the proxy's own counts (never raises)."""
        assert self._session is not None
        interval = self.settings.engine_metrics_interval_s
        try:
            async with self._session.get(e.spec.url.rstrip("/") + "/metrics",
                                         timeout=aiohttp.ClientTimeout(total=interval)) as r:
                text = await r.text() if r.status == 200 else ""
            e.reported.update(parse_engine_load(text) if text else None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("%s /metrics: %s", e.name, exc)
            e.reported.update(None)

    async def _scrape_loop(self) -> None:
        interval = self.settings.engine_metrics_interval_s
        while True:
            await asyncio.gather(*(self._scrape(e) for e in self.engines if e.alive))
            await asyncio.sleep(interval)

    # ------------------------------------------------------------------ lifecycle

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Subscribe to every publisher and listen; returns the bound port. Raises OSError
        if the port cannot be bound."""
        self.consumer = EventConsumer(
            [(ep, replay) for ep, (replay, _names) in self._endpoints.items()],
            replay_timeout_s=self.settings.replay_timeout_s, listener=self)
        self._thread = threading.Thread(target=self._follow_events, name="kvpool-route-events",
                                        daemon=True)
        self._thread.start()
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.settings.request_timeout_s))
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        if self.settings.engine_metrics_interval_s > 0:
            self._scraper = asyncio.create_task(self._scrape_loop())
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        return int(sockets[0].getsockname()[1]) if sockets else port

    async def close(self) -> None:
        if self._scraper is not None:
            self._scraper.cancel()
            await asyncio.gather(self._scraper, return_exceptions=True)
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)
        if self.consumer is not None:
            self.consumer.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    # ------------------------------------------------------------------ routing

    def candidates(self, tokens: Sequence[int] | None) -> list[Candidate]:
        """Per engine: cached prefix by tier (disjoint) and load. ``tokens`` None: load only."""
        pool_keys: list[bytes] = []
        ns = self.settings.namespace_id
        if tokens and ns is not None:
            pool_keys = chunk_keys(ns, tokens, self.settings.chunk_tokens)
        ct = self.settings.chunk_tokens
        out = []
        with self._lock:
            storage = 0
            if pool_keys and self.consumer is not None:
                storage = self.consumer.leading_run(
                    self._pool_nodes(self.settings.storage_events), ns or b"", pool_keys) * ct
            for i, e in enumerate(self.engines):
                eng = host = 0
                if tokens:
                    eng = e.index.cached_tokens(tokens)
                if pool_keys and self.consumer is not None and e.spec.host_events:
                    host = self.consumer.leading_run(self._pool_nodes(e.spec.host_events),
                                                     ns or b"", pool_keys) * ct
                out.append(Candidate(i, eng, max(0, host - eng),
                                     max(0, storage - max(eng, host)), self.load(e),
                                     e.pending_tokens, e.alive))
        return out

    def _choose(self, tokens: list[int] | None, reason: str | None,
                exclude: set[int]) -> tuple[int, int]:
        """(engine, its uncached prompt tokens). Raises NoEngineError."""
        cands = self.candidates(tokens)
        cands = [c if c.index not in exclude else Candidate(c.index, alive=False)
                 for c in cands]
        policy = self._fallback if tokens is None else self.policy
        d = policy.choose(cands)
        self._decisions.labels(reason or d.reason).inc()
        n = len(tokens or ())
        return d.index, max(0, n - cands[d.index].cached_tokens)

    async def _tokenize(self, body: dict[str, Any], chat: bool) -> list[int]:
        """Token ids from the least-loaded alive engine's /tokenize. Raises on any failure."""
        assert self._session is not None
        if not chat and isinstance(body.get("prompt"), list) and all(
                isinstance(t, int) for t in body["prompt"]):
            return list(body["prompt"])
        alive = [e for e in self.engines if e.alive] or self.engines
        e = min(alive, key=lambda x: (x.pending_tokens, x.in_flight))
        req: dict[str, Any] = {"model": body.get("model")}
        if chat:
            req["messages"] = body.get("messages")
        else:
            req["prompt"] = body.get("prompt")
        async with self._session.post(e.spec.url.rstrip("/") + "/tokenize", json=req) as r:
            if r.status != 200:
                raise ValueError(f"/tokenize answered {r.status}")
            data = await r.json()
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list):
            raise ValueError("/tokenize answered no tokens")
        return [int(t) for t in tokens]

    async def _route(self, request: web.Request, path: str, chat: bool) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return web.json_response({"error": "the body must be a JSON object"}, status=400)
        tokens: list[int] | None = None
        reason: str | None = None
        try:
            tokens = await asyncio.wait_for(self._tokenize(body, chat),
                                            self.settings.index_timeout_s)
        except TimeoutError:
            reason = REASON_INDEX_TIMEOUT
        except (aiohttp.ClientError, ValueError, TypeError) as exc:
            log.debug("tokenize failed: %s", exc)
            reason = REASON_INDEX_ERROR
        headers = {h: request.headers[h] for h in _FORWARD_HEADERS if h in request.headers}
        tried: set[int] = set()
        while True:
            try:
                idx, uncached = self._choose(tokens, reason, tried)
            except NoEngineError:
                return web.json_response({"error": "no engine is alive"}, status=503)
            e = self.engines[idx]
            try:
                return await self._forward(request, e, path, raw, headers, uncached)
            except _EngineDown:
                tried.add(idx)
                reason = None if tokens is not None else reason

    async def _forward(self, request: web.Request, e: _Engine, path: str, raw: bytes,
                       headers: dict[str, str], uncached: int) -> web.StreamResponse:
        """Send the body to ``e`` and stream its answer back. Raises _EngineDown if the
        engine cannot be reached (nothing sent to the client yet)."""
        assert self._session is not None
        e.in_flight += 1
        e.pending_tokens += uncached
        answered = False
        try:
            try:
                upstream = await self._session.post(e.spec.url.rstrip("/") + path, data=raw,
                                                    headers=headers)
            except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                self._mark_dead(e, exc)
                raise _EngineDown from exc
            async with upstream:
                resp = web.StreamResponse(status=upstream.status)
                ctype = upstream.headers.get("Content-Type")
                if ctype:
                    resp.headers["Content-Type"] = ctype
                resp.headers["X-Kvpool-Engine"] = e.name
                await resp.prepare(request)
                try:
                    async for chunk in upstream.content.iter_any():
                        if not answered:
                            answered = True
                            e.pending_tokens -= uncached
                        await resp.write(chunk)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    log.warning("%s failed mid-answer: %s", e.name, exc)
                    self._mark_dead(e, exc)
                await resp.write_eof()
                return resp
        finally:
            e.in_flight -= 1
            if not answered:
                e.pending_tokens -= uncached

    def _mark_dead(self, e: _Engine, exc: BaseException) -> None:
        log.warning("%s (%s) is down: %s", e.name, e.spec.url, exc)
        e.dead_until = time.monotonic() + self.settings.dead_cooldown_s
        # It comes back with an empty cache: forget it now rather than on its first event.
        with self._lock:
            e.index.clear()
            self._count_reset(e.name, RESET_DEAD)

    # ------------------------------------------------------------------ handlers

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._route(request, "/v1/completions", chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._route(request, "/v1/chat/completions", chat=True)

    async def _models(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        for e in [e for e in self.engines if e.alive]:
            try:
                async with self._session.get(e.spec.url.rstrip("/") + "/v1/models") as r:
                    return web.Response(status=r.status, body=await r.read(),
                                        content_type="application/json")
            except aiohttp.ClientError as exc:
                self._mark_dead(e, exc)
        return web.json_response({"error": "no engine is alive"}, status=503)

    async def _healthz(self, request: web.Request) -> web.Response:
        up = sum(e.alive for e in self.engines)
        return web.json_response({"engines": len(self.engines), "up": up},
                                 status=200 if up else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        for e in self.engines:
            self._in_flight.labels(e.name).set(e.in_flight)
            self._reported.labels(e.name).set(e.reported.running + e.reported.waiting)
            self._pending.labels(e.name).set(e.pending_tokens)
            self._up.labels(e.name).set(1 if e.alive else 0)
        with self._lock:
            for source, (_replay, names) in self._endpoints.items():
                engine = self._engine_at.get(source)
                blocks = len(engine.index) if engine is not None else self._held(source)
                for name in names:
                    stats = self.sources[name]
                    self._lag.labels(name).set(stats.lag_s())
                    self._delay.labels(name).set(stats.delay_s)
                    self._blocks.labels(name).set(blocks)
        return web.Response(body=generate_latest(self.registry),
                            content_type="text/plain", charset="utf-8")


    def _held(self, source: str) -> int:
        """Chunks a kvpool publisher announced it holds (all media, all namespaces)."""
        if self.consumer is None or source not in self.consumer.node_at:
            return 0
        state = self.consumer.nodes.get(self.consumer.node_at[source])
        return len(set().union(*state.held.values())) if state and state.held else 0


class _EngineDown(Exception):
    """The chosen engine could not be reached; try the next."""
