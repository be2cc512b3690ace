"""kvpool route: real sockets throughout (aiohttp engines standing in for vLLM's OpenAI
server, a real ZMQ publisher of vLLM-format KV events): prefix routing, SSE passthrough, an
engine restart and a lost event resetting its index, a dead engine routed around, a slow
tokenizer falling back to least-loaded, and the host-pool tier from kvpool's events."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

from kvtest import require_extra

aiohttp = require_extra("aiohttp", "router")
require_extra("zmq", "router")
require_extra("msgspec", "router")

from route_support import FakeEngine, Publisher, stored, tokens_of, until  # noqa: E402

from kvpool.keys import chunk_keys  # noqa: E402
from kvpool.route.policy import KvPolicy  # noqa: E402
from kvpool.route.proxy import EngineSpec, Router, RouterSettings  # noqa: E402

PROMPT = "abcdefghijklmnopqrstuvwx"  # 24 tokens: 6 blocks of 4


def _run(coro: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(coro())


async def _post(port: int, body: dict[str, object], path: str = "/v1/completions"
                ) -> tuple[int, str, bytes]:
    async with aiohttp.ClientSession() as s, s.post(
            f"http://127.0.0.1:{port}{path}", json=body) as r:
        return r.status, r.headers.get("X-Kvpool-Engine", ""), await r.read()


async def _metrics(port: int) -> str:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
        return await r.text()


def _blocks(text: str, n: int, size: int = 4, first: int = 100) -> list[dict[str, object]]:
    """One BlockStored per block of ``text``'s first n blocks, chained by parent hash."""
    toks = tokens_of(text)
    return [stored([first + i], toks[i * size:(i + 1) * size], size,
                   parent=None if i == 0 else first + i - 1) for i in range(n)]


class _Fleet:
    def __init__(self, n: int, **router_kw: object) -> None:
        self.engines = [FakeEngine(f"e{i}") for i in range(n)]
        self.pubs = [Publisher() for _ in range(n)]
        self.router_kw = router_kw
        self.router: Router | None = None
        self.port = 0

    async def __aenter__(self) -> _Fleet:
        urls = [await e.start() for e in self.engines]
        specs = [EngineSpec(u, p.endpoint) for u, p in zip(urls, self.pubs, strict=True)]
        kw = {"policy": KvPolicy(), "index_timeout_s": 5.0, **self.router_kw}
        self.router = Router(RouterSettings(specs, **kw))  # type: ignore[arg-type]
        self.port = await self.router.start()
        for i, p in enumerate(self.pubs):  # past ZMQ's slow joiner
            src = self.router.sources[f"engine{i}"]
            await until(lambda src=src: src.batches > 0, "subscription",
                        poke=lambda p=p: p.send([]))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.router is not None
        await self.router.close()
        for e in self.engines:
            await e.stop()
        for p in self.pubs:
            p.close()


def test_routes_to_the_engine_holding_the_prefix_and_streams() -> None:
    async def body() -> None:
        async with _Fleet(3) as f:
            assert f.router is not None
            f.pubs[2].send(_blocks(PROMPT, 5))
            ix = f.router.engines[2].index
            await until(lambda: len(ix) == 5, "5 blocks indexed")
            assert ix.cached_tokens(tokens_of(PROMPT)) == 20
            for _ in range(3):
                status, engine, out = await _post(f.port, {"model": "m", "prompt": PROMPT})
                assert (status, engine) == (200, "engine2")
                assert json.loads(out)["engine"] == "e2"
            # Chat completions go through the same scoring (the fake tokenizes the contents).
            status, engine, out = await _post(
                f.port, {"model": "m", "messages": [{"role": "user", "content": PROMPT}],
                         "stream": True}, "/v1/chat/completions")
            assert (status, engine) == (200, "engine2")
            lines = [x for x in out.decode().split("\n\n") if x]
            assert lines[-1] == "data: [DONE]" and len(lines) == 4
            assert [json.loads(x[6:])["i"] for x in lines[:3]] == [0, 1, 2]
            # A prompt nobody holds spreads by load.
            picks = {(await _post(f.port, {"model": "m", "prompt": "zzzzzzzz"}))[1]
                     for _ in range(6)}
            assert len(picks) >= 2
            text = await _metrics(f.port)
            assert 'kvpool_route_decisions_total{reason="prefix"} 4.0' in text
            assert 'kvpool_route_index_blocks{source="engine2"} 5.0' in text
            assert 'kvpool_route_in_flight{engine="engine0"} 0.0' in text
            assert (await _post(f.port, {"model": "m"}))[0] in (200, 400)
            async with aiohttp.ClientSession() as s, s.post(
                    f"http://127.0.0.1:{f.port}/v1/completions", data=b"[1, 2") as r:
                assert r.status == 400
    _run(body)


def test_restart_and_lost_event_reset_the_engine_index() -> None:
    async def body() -> None:
        async with _Fleet(2) as f:
            assert f.router is not None
            ix = f.router.engines[1].index
            f.pubs[1].send(_blocks(PROMPT, 4))
            await until(lambda: len(ix) == 4, "4 blocks")
            # A lost event: the next batch skips a sequence number.
            f.pubs[1].send(_blocks("0123456789AB", 2, first=500), seq=f.pubs[1].seq + 1)
            src = f.router.sources["engine1"]
            await until(lambda: src.resets.get("gap") == 1, "gap reset")
            assert len(ix) == 2 and ix.cached_tokens(tokens_of(PROMPT)) == 0
            # The engine restarted: its publisher counts from 0 again, with an empty cache.
            f.pubs[1].send([], seq=0)
            await until(lambda: src.resets.get("restart") == 1, "restart reset")
            assert len(ix) == 0
            # AllBlocksCleared (a cache reset) empties it too.
            f.pubs[1].send(_blocks(PROMPT, 2))
            await until(lambda: len(ix) == 2, "2 blocks")
            f.pubs[1].send([{"type": "AllBlocksCleared"}])
            await until(lambda: len(ix) == 0, "cleared")
            text = await _metrics(f.port)
            for reason in ("gap", "restart", "cleared"):
                assert (f'kvpool_route_index_resets_total{{reason="{reason}",'
                        f'source="engine1"}} 1.0') in text
            assert "kvpool_route_index_lag_seconds" in text
            assert "kvpool_route_index_delay_seconds" in text
    _run(body)


def test_removed_blocks_and_unknown_parents_never_give_false_hits() -> None:
    async def body() -> None:
        async with _Fleet(1) as f:
            assert f.router is not None
            ix = f.router.engines[0].index
            toks = tokens_of(PROMPT)
            # Block 2 whose parent was never seen: skipped.
            f.pubs[0].send([stored([7], toks[8:12], 4, parent=999)])
            f.pubs[0].send(_blocks(PROMPT, 3))
            await until(lambda: len(ix) == 3, "3 blocks")
            assert ix.cached_tokens(toks) == 12
            f.pubs[0].send([{"type": "BlockRemoved", "block_hashes": [101],
                             "medium": "GPU"}])
            await until(lambda: len(ix) == 2, "removal")
            assert ix.cached_tokens(toks) == 4
    _run(body)


def test_dead_engine_is_routed_around() -> None:
    async def body() -> None:
        async with _Fleet(2, dead_cooldown_s=60.0) as f:
            assert f.router is not None
            f.pubs[0].send(_blocks(PROMPT, 5))
            await until(lambda: len(f.router.engines[0].index) == 5, "blocks")  # type: ignore[union-attr]
            await f.engines[0].stop()
            for _ in range(3):
                status, engine, out = await _post(f.port, {"model": "m", "prompt": PROMPT,
                                                           "stream": True})
                assert (status, engine) == (200, "engine1")
                assert out.endswith(b"data: [DONE]\n\n")
            assert not f.router.engines[0].alive
            assert f.router.sources["engine0"].resets.get("dead") == 1
            assert 'kvpool_route_engine_up{engine="engine0"} 0.0' in await _metrics(f.port)
            await f.engines[1].stop()
            assert (await _post(f.port, {"model": "m", "prompt": PROMPT}))[0] == 503
    _run(body)


def test_slow_tokenizer_falls_back_to_least_loaded() -> None:
    async def body() -> None:
        async with _Fleet(2, index_timeout_s=0.2) as f:
            assert f.router is not None
            for e in f.engines:
                e.tokenize_delay_s = 1.5
            f.pubs[1].send(_blocks(PROMPT, 5))
            await until(lambda: len(f.router.engines[1].index) == 5, "blocks")  # type: ignore[union-attr]
            picks = [(await _post(f.port, {"model": "m", "prompt": PROMPT}))
                     for _ in range(4)]
            assert all(p[0] == 200 for p in picks)
            assert {p[1] for p in picks} == {"engine0", "engine1"}  # spread, not by prefix
            assert 'kvpool_route_decisions_total{reason="index_timeout"} 4.0' in \
                await _metrics(f.port)
    _run(body)


def _pool_stored(keys: list[bytes], ns: bytes) -> dict[str, object]:
    """A kvpool host pool's BlockStored (docs/routing.md, section 1)."""
    return {"type": "BlockStored", "block_hashes": keys, "parent_block_hash": None,
            "token_ids": [], "block_size": 8, "lora_id": None, "medium": "CPU",
            "lora_name": None, "namespace_id": ns}


def test_host_pool_events_credit_their_engine() -> None:
    async def body() -> None:
        ns = bytes(range(16))
        host = Publisher(incarnation="a1", node="host1")
        engines = [FakeEngine("e0"), FakeEngine("e1")]
        urls = [await e.start() for e in engines]
        router = Router(RouterSettings(
            [EngineSpec(urls[0]), EngineSpec(urls[1], host_events=(host.endpoint,))],
            KvPolicy(), namespace_id=ns, chunk_tokens=8))
        port = await router.start()
        try:
            src = router.sources["engine1-host0"]
            await until(lambda: src.batches > 0, "subscription", poke=lambda: host.send([]))
            keys = chunk_keys(ns, tokens_of(PROMPT), 8)
            host.send([_pool_stored(keys[:2], ns)])
            await until(lambda: router.candidates(tokens_of(PROMPT))[1].host_tokens == 16,
                        "host chunks")
            c = router.candidates(tokens_of(PROMPT))
            assert (c[1].engine_tokens, c[1].host_tokens, c[0].host_tokens) == (0, 16, 0)
            assert (await _post(port, {"model": "m", "prompt": PROMPT}))[1] == "engine1"
            assert 'kvpool_route_index_blocks{source="engine1-host0"} 2.0' in \
                await _metrics(port)
            # The host pool restarted (a new incarnation): its chunks are forgotten.
            host.incarnation = "b2"
            host.send([])
            await until(lambda: src.resets == {"restart": 1}, "reset on new incarnation")
            assert router.candidates(tokens_of(PROMPT))[1].host_tokens == 0
        finally:
            await router.close()
            for e in engines:
                await e.stop()
            host.close()
    _run(body)


def test_a_lost_batch_is_replayed_not_reset() -> None:
    """A storage node's publisher with its replay socket: a batch the router missed is
    asked again and applied (the chunks it announced count), with no reset; a storage
    node's filed keys (key_scope "namespace") are matched from the prompt's chunk keys."""
    from kvpool.events.publisher import EventPublisher, PublisherSettings
    from kvpool.events.schema import KEY_SCOPE_NAMESPACE, filed_keys

    async def body() -> None:
        ns = bytes(range(16))
        pub = EventPublisher(PublisherSettings(batch_interval_s=0.02,
                                               key_scope=KEY_SCOPE_NAMESPACE), "node-a")
        engines = [FakeEngine("e0"), FakeEngine("e1")]
        urls = [await e.start() for e in engines]
        router = Router(RouterSettings(
            [EngineSpec(u) for u in urls], KvPolicy(), storage_events=(pub.endpoint,),
            storage_replays=(pub.replay_endpoint,), namespace_id=ns, chunk_tokens=8))
        await router.start()
        sink = pub.sink("DISK")
        # what a node announces: its filing of the prompt's chunk keys
        keys = filed_keys(KEY_SCOPE_NAMESPACE, ns, chunk_keys(ns, tokens_of(PROMPT), 8))
        try:
            src = router.sources["storage0"]
            await until(lambda: src.batches > 0, "subscription",
                        poke=lambda: sink.removed([b"x" * 16], ns))
            consumer = router.consumer
            assert consumer is not None
            await asyncio.sleep(0.2)  # the last pokes sent and applied
            await until(lambda: consumer.nodes["node-a"].last_seq == pub.next_seq - 1,
                        "every batch sent applied")
            lost = pub.next_seq
            with router._lock:
                consumer.skip_seqs.add(lost)  # as if the network lost it
            sink.stored(keys[:1], ns)
            await until(lambda: pub.next_seq > lost, "the lost batch sent")
            sink.stored(keys[1:2], ns)
            await until(lambda: router.candidates(tokens_of(PROMPT))[0].storage_tokens == 16,
                        "both chunks, the first from replay")
            assert src.resets == {}
            state = consumer.nodes["node-a"]
            assert state.replayed >= 1 and state.resets == 0
        finally:
            await router.close()
            for e in engines:
                await e.stop()
            pub.close()
    _run(body)


def _vllm_metrics(running: int, waiting: int) -> str:
    return ("# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}.0\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}.0\n')


def test_engine_metrics_count_load_the_proxy_did_not_send() -> None:
    """Requests another client sent straight to engine0 show in its /metrics: the router
    counts them as its load and sends new requests to engine1; a scrape that fails, or
    finds no vLLM gauges, leaves only the proxy's own counts."""
    async def body() -> None:
        async with _Fleet(2, engine_metrics_interval_s=0.1) as f:
            assert f.router is not None
            f.engines[0].metrics_text = _vllm_metrics(3, 5)
            f.engines[1].metrics_text = _vllm_metrics(0, 0)
            await until(lambda: [c.load for c in f.router.candidates(None)] == [8.0, 0.0],  # type: ignore[union-attr]
                        "engine0's own load read")
            picks = {(await _post(f.port, {"model": "m", "prompt": PROMPT}))[1]
                     for _ in range(3)}
            assert picks == {"engine1"}
            assert 'kvpool_route_engine_reported_requests{engine="engine0"} 8.0' in \
                await _metrics(f.port)
            f.engines[0].metrics_text = None  # /metrics gone: a 404
            await until(lambda: f.router.candidates(None)[0].load == 0.0,  # type: ignore[union-attr]
                        "a failed scrape leaves the proxy's own count")
            f.engines[0].metrics_text = "# nothing of vLLM's here\n"
            await asyncio.sleep(0.3)
            assert f.router.candidates(None)[0].load == 0.0
            picks = {(await _post(f.port, {"model": "m", "prompt": PROMPT}))[1]
                     for _ in range(4)}
            assert picks == {"engine0", "engine1"}
    _run(body)


def test_route_command_serves_and_stops_on_sigterm() -> None:
    """``kvpool route`` as its own process: bad options exit 2; it proxies to a real engine
    socket and exits 0 on SIGTERM."""
    import os
    import signal
    import socket
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-c", "import sys; from kvpool.cli import main; sys.exit(main())",
           "route"]
    from kvpool.cli import main
    assert main(["route", "--engine", "ftp://x"]) == 2
    assert main(["route", "--engine", "http://x,events"]) == 2
    assert main(["route", "--engine", "http://x", "--namespace-id", "abcd"]) == 2

    async def body() -> None:
        engine = FakeEngine("e0")
        url = await engine.start()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = await asyncio.create_subprocess_exec(
            *cmd, "--engine", url, "--port", str(port), env=env,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        try:
            async def up() -> bool:
                try:
                    async with aiohttp.ClientSession() as s, s.get(
                            f"http://127.0.0.1:{port}/healthz") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False
            for _ in range(600):
                if await up():
                    break
                await asyncio.sleep(0.1)
            status, engine_name, out = await _post(port, {"model": "m", "prompt": PROMPT})
            assert (status, engine_name, json.loads(out)["engine"]) == (200, "engine0", "e0")
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 60) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await engine.stop()
    _run(body)


def test_consumer_names_vllm_publishers_by_endpoint_and_drops_bad_messages() -> None:
    """Two vLLM-format publishers (no node, no incarnation) are two publishers, named by
    their endpoints; a malformed message is counted and dropped, and the batch after it is
    a gap (no replay socket: a reset), never a crash of the consumer."""
    import time

    from kvpool.events.consumer import RESET_GAP, EventConsumer

    pubs = [Publisher(), Publisher()]
    resets: list[tuple[str, str, str]] = []
    seen: list[tuple[str, int]] = []

    class Listener:
        def batch(self, node: str, source: str, seq: int, batch: object) -> None:
            seen.append((node, seq))

        def reset(self, node: str, source: str, reason: str) -> None:
            resets.append((node, source, reason))

    consumer = EventConsumer([(p.endpoint, None) for p in pubs], listener=Listener())
    try:
        deadline = time.monotonic() + 20
        while {n for n, _ in seen} != {p.endpoint for p in pubs}:
            assert time.monotonic() < deadline, "subscriptions"
            for p in pubs:
                p.send([])
            consumer.poll(0.05)
        assert set(consumer.nodes) == {p.endpoint for p in pubs}
        pubs[0].sock.send_multipart([b"", b"short"])  # not [topic, 8-byte seq, payload]
        pubs[0].seq += 1  # the publisher counted it: the next batch is a gap
        pubs[0].send(_blocks(PROMPT, 1))
        while not resets:
            assert time.monotonic() < deadline, "the gap after the bad message"
            consumer.poll(0.05)
        assert consumer.bad_messages == 1
        assert resets == [(pubs[0].endpoint, pubs[0].endpoint, RESET_GAP)]
        assert consumer.nodes[pubs[1].endpoint].resets == 0
    finally:
        consumer.close()
        for p in pubs:
            p.close()
