"""Workload sizes (presets) and the demo's entry point :func:`build_streams`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvpool.demo.workloads.chat import ChatStream, ChatTurn, chat_requests
from kvpool.demo.workloads.docqa import docqa_requests
from kvpool.demo.workloads.request import Request, RequestList
from kvpool.demo.workloads.trace import _is_int, trace_requests

__all__ = [
    "DEFAULT",
    "DEMO_CHUNK_TOKENS",
    "QUICK",
    "ChatParams",
    "DocQAParams",
    "Preset",
    "TraceParams",
    "build_streams",
]


@dataclass(frozen=True)
class ChatParams:
    """Keyword arguments of :func:`chat_requests`."""

    sessions: int = 3
    turns: int = 3
    system_tokens: int = 1024
    user_tokens: int = 64
    max_new_tokens: int = 24


@dataclass(frozen=True)
class DocQAParams:
    """Keyword arguments of :func:`docqa_requests`."""

    doc_tokens: tuple[int, ...] = (3500, 6000)
    questions: int = 2
    max_new_tokens: int = 24


@dataclass(frozen=True)
class TraceParams:
    """Keyword arguments of :func:`trace_requests` (``max_requests`` comes from the CLI)."""

    block_tokens: int = 32
    max_prompt_tokens: int = 4096
    max_new_tokens: int = 8


@dataclass(frozen=True)
class Preset:
    """Workload sizes; pass ``**asdict(preset.chat)`` etc. to the builders."""

    chat: ChatParams = field(default_factory=ChatParams)
    docqa: DocQAParams = field(default_factory=DocQAParams)
    trace: TraceParams = field(default_factory=TraceParams)


DEFAULT = Preset()
QUICK = Preset(
    chat=ChatParams(sessions=2, turns=2, system_tokens=384, user_tokens=48, max_new_tokens=8),
    docqa=DocQAParams(doc_tokens=(2000,), questions=2, max_new_tokens=8),
    trace=TraceParams(block_tokens=32, max_prompt_tokens=1024, max_new_tokens=4),
)

Stream = ChatStream | RequestList


def _max_positions(model: Any) -> int | None:
    value = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return value if _is_int(value) else None


def _vocab_size(tokenizer: Any, model: Any) -> int:
    sizes = [getattr(tokenizer, "vocab_size", None),
             getattr(getattr(model, "config", None), "vocab_size", None)]
    known = [s for s in sizes if _is_int(s) and s > 0]
    if not known:
        raise ValueError("cannot tell the vocabulary size of the tokenizer or the model")
    return min(known)


#: Chunk size of the demo. A CPU prefills a few hundred tokens per second, so the tokens after
#: the last full chunk (on average half a chunk) cost real time; 32 keeps that small while a
#: chunk of SmolLM2 KV is still 1.4 MiB. GPU engines use 256 (kvpool's default) and larger.
DEMO_CHUNK_TOKENS = 32


def build_streams(args: argparse.Namespace, tokenizer: Any,
                  model: Any) -> tuple[int, str, Callable[[], list[Stream]]]:
    """The demo's workloads from its CLI arguments: (chunk tokens, description, make_streams).

    Reads ``args.quick``, ``args.workloads``, ``args.trace``, ``args.trace_start``,
    ``args.trace_requests`` and ``args.chunk_tokens`` (None: DEMO_CHUNK_TOKENS, or the scaled
    trace block with ``--trace``).
    ``make_streams()`` returns fresh streams for one replay (chat sessions start empty).
    Raises ValueError for unknown workloads or prompts longer than the model's context.
    """
    preset = QUICK if getattr(args, "quick", False) else DEFAULT
    limit = _max_positions(model)
    chunk: int | None = getattr(args, "chunk_tokens", None)
    trace = getattr(args, "trace", None)
    if trace:
        params = preset.trace
        cap = params.max_prompt_tokens
        if limit is not None:
            cap = min(cap, limit - params.max_new_tokens)
        requests, info = trace_requests(
            trace, _vocab_size(tokenizer, model), block_tokens=params.block_tokens,
            max_prompt_tokens=cap, max_requests=getattr(args, "trace_requests", 40),
            start=getattr(args, "trace_start", 0), max_new_tokens=params.max_new_tokens,
            special_ids=list(getattr(tokenizer, "all_special_ids", []) or []))
        describe = (f"trace {info['trace']}: {info['requests']} of {info['trace_requests']} "
                    f"requests, {info['source_block_tokens']}-token blocks scaled to "
                    f"{info['block_tokens']} tokens, prompts <= {info['max_prompt_tokens']} "
                    f"tokens ({info['capped_requests']} capped), {info['unique_blocks']} "
                    f"unique blocks, {info['reused_blocks']} reused")
        return (chunk or params.block_tokens, describe,
                lambda: [RequestList("trace", requests)])
    names = [w.strip() for w in str(getattr(args, "workloads", "chat,docqa")).split(",")
             if w.strip()]
    unknown = [w for w in names if w not in ("chat", "docqa")]
    if unknown or not names:
        raise ValueError(f"unknown workload(s) {unknown or names}; known: chat, docqa")
    parts: list[str] = []
    turns: list[ChatTurn] = []
    docqa: list[Request] = []
    if "chat" in names:
        c = preset.chat
        turns = chat_requests(tokenizer, **asdict(c))
        parts.append(f"chat {c.sessions} sessions x {c.turns} turns ({c.system_tokens}-token "
                     f"system prompt, {c.user_tokens}-token user turns, {c.max_new_tokens} new "
                     "tokens)")
    if "docqa" in names:
        d = preset.docqa
        docqa = docqa_requests(tokenizer, **asdict(d))
        sizes = ", ".join(str(n) for n in d.doc_tokens)
        parts.append(f"docqa {len(d.doc_tokens)} doc(s) of {sizes} tokens x {d.questions} "
                     f"questions ({d.max_new_tokens} new tokens)")
    if limit is not None:
        longest = [len(r.prompt) + r.max_new_tokens for r in docqa]
        # A chat prompt also holds the replies of the session's earlier turns.
        longest += [len(r.prompt) + t.turn * t.max_new_tokens
                    for r, t in zip(ChatStream(turns).peek(), turns, strict=True)]
        if longest and max(longest) > limit:
            raise ValueError(f"a prompt needs {max(longest)} positions; the model has {limit}")

    def make_streams() -> list[Stream]:
        streams: list[Stream] = []
        if turns:
            streams.append(ChatStream(turns))
        if docqa:
            streams.append(RequestList("docqa", docqa))
        return streams

    return chunk or DEMO_CHUNK_TOKENS, "; ".join(parts), make_streams
