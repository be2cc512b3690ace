"""Real-socket stand-ins for the router tests: an OpenAI-ish engine server (aiohttp) and a
vLLM-format KV-event publisher (ZMQ PUB)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
from aiohttp import web


def tokens_of(text: str) -> list[int]:
    return [ord(c) for c in text]


class FakeEngine:
    """/tokenize (a character a token), /v1/completions and /v1/chat/completions (JSON or
    SSE naming the engine), /v1/models. ``tokenize_delay_s`` slows /tokenize."""

    def __init__(self, name: str, tokenize_delay_s: float = 0.0) -> None:
        self.name = name
        self.tokenize_delay_s = tokenize_delay_s
        self.served = 0
        self.port = 0
        #: what /metrics answers (vLLM's gauges); None: a 404, as an engine without it
        self.metrics_text: str | None = None
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        await asyncio.sleep(self.tokenize_delay_s)
        text = body.get("prompt") or "".join(m["content"] for m in body.get("messages", []))
        return web.json_response({"tokens": tokens_of(text), "count": len(text)})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.served += 1
        if not body.get("stream"):
            return web.json_response({"engine": self.name, "echo": body})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            choice: dict[str, Any] = {"text": f"t{i}"}
            if body.get("return_token_ids"):  # as vLLM: the prompt's ids on the first chunk
                choice["token_ids"] = [i]
                if i == 0:
                    choice["prompt_token_ids"] = body.get("prompt")
            chunk = {"engine": self.name, "i": i, "choices": [choice]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.01)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.metrics_text is None:
            return web.Response(status=404)
        return web.Response(text=self.metrics_text)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake"}]})


class Publisher:
    """A ZMQ PUB sending vLLM's ``[topic, seq, KVEventBatch]`` messages."""

    def __init__(self, incarnation: str | None = None, node: str = "n") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.seq = 0
        self.incarnation = incarnation
        self.node = node

    def send(self, events: list[dict[str, Any]], seq: int | None = None) -> None:
        if seq is not None:
            self.seq = seq
        batch: list[Any] = [time.time(), events, None]
        if self.incarnation is not None:
            batch += [self.node, self.incarnation]
        self.sock.send_multipart([b"", self.seq.to_bytes(8, "big"),
                                  msgspec.msgpack.encode(batch)])
        self.seq += 1

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def stored(hashes: list[Any], tokens: list[int], block_size: int, parent: Any = None,
           medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": block_size, "lora_id": None, "medium": medium,
            "lora_name": None}


async def until(cond: Callable[[], bool], what: str, timeout_s: float = 20.0,
                poke: Callable[[], None] | None = None) -> None:
    """Wait for ``cond``, calling ``poke`` between checks (a publisher's slow joiner)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        if poke is not None:
            poke()
        await asyncio.sleep(0.05)
