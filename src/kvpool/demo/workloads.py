"""Request workloads for ``kvpool demo``, built as token ids.

Three workloads, each a list of requests replayed in order:

* **chat** (:func:`chat_requests`): several sessions share one long system prompt; every turn
  appends a user message to its session's history, and the model's reply to turn *t* becomes
  part of turn *t+1*'s prompt. Replies are only known at run time, so chat is built as
  :class:`ChatTurn` objects that hold only the tokens a turn *adds*; a :class:`ChatSession` per
  session keeps the history::

      sessions: dict[str, ChatSession] = {}
      for turn in chat_requests(tokenizer):
          session = sessions.setdefault(turn.session, ChatSession(turn.session))
          request = session.request_for(turn)      # prompt = history + turn.tokens
          reply = generate(request.prompt, request.max_new_tokens)
          session.add_reply(reply)                 # history = prompt + reply

  Every prompt of a session is therefore a strict prefix of the session's next prompt, and all
  sessions start with the same system-prompt tokens. :class:`ChatStream` wraps exactly this
  loop behind ``__iter__`` / ``reply``. Use fresh sessions (a fresh stream) for every replay.
* **docqa** (:func:`docqa_requests`): long documents, several questions each, interleaved
  (doc A q1, doc B q1, doc A q2, ...); prompt = document tokens + question tokens, so the
  questions on one document share the document as prefix.
* **trace** (:func:`trace_requests`): a request trace in the format of ``shared/traces``
  (JSON lines with ``timestamp``, ``input_length``, ``output_length``, ``hash_ids``), scaled
  down so that a CPU can run it: every 512-token hash block becomes a deterministic block of
  ``block_tokens`` random token ids seeded by its hash id, so equal ids give equal tokens.

Text comes from the Python standard library's own documentation (``inspect.getdoc`` of a fixed
list of modules, their public classes, functions and methods): real English, offline, and the
same on the same Python version. Token sequences are built by concatenating
``tokenizer.encode(piece, add_special_tokens=False)`` of text pieces and truncating at token
level, never by re-tokenizing a whole prompt, so shared prefixes are exact.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import random
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TypeGuard

import numpy as np

__all__ = [
    "DEFAULT",
    "MODULES",
    "QUESTIONS",
    "QUICK",
    "ChatParams",
    "ChatSession",
    "ChatStream",
    "ChatTurn",
    "DocQAParams",
    "Preset",
    "Request",
    "RequestList",
    "TokenizerLike",
    "TraceParams",
    "build_streams",
    "chat_requests",
    "docqa_requests",
    "module_text",
    "reference_texts",
    "trace_requests",
]

#: Standard-library modules whose documentation is the text source, in a fixed order. Chosen to
#: be the same on every platform (no ``os``, ``sys``, ``socket``, ``selectors`` ...).
MODULES: tuple[str, ...] = (
    "collections", "json", "argparse", "asyncio.locks", "threading", "pathlib", "re",
    "unittest", "logging", "email.message", "http.client", "functools", "itertools",
    "datetime", "decimal", "statistics", "textwrap", "csv", "zipfile", "tarfile", "shutil",
    "tempfile", "heapq", "contextlib", "dataclasses", "typing", "io", "struct", "hashlib",
    "base64", "urllib.parse", "xml.etree.ElementTree", "configparser", "difflib", "queue",
    "calendar", "random", "asyncio.queues", "asyncio.tasks", "concurrent.futures", "ipaddress",
    "weakref", "gzip", "codecs", "smtplib", "imaplib", "ftplib", "uuid", "optparse", "timeit",
    "pdb", "doctest",
)

#: Questions asked about a document (docqa).
QUESTIONS: tuple[str, ...] = (
    "What is the main purpose of the module described above?",
    "Which classes does the documentation above describe, and what is each one for?",
    "Summarize the documentation above in three sentences.",
    "What errors or exceptions can the functions described above raise?",
    "Give a short example of how to use the module described above.",
    "Which functions described above are safe to use from several threads?",
    "What are the most important parameters mentioned in the documentation above?",
    "How would you explain the module described above to a beginner?",
)

#: Opening sentences of chat user messages; a documentation excerpt follows each.
USER_OPENERS: tuple[str, ...] = (
    "I am trying to understand this part of the documentation. What does it mean?",
    "Can you explain the following passage in simpler words?",
    "My code does not behave the way this passage suggests. What am I missing?",
    "Is the following description still accurate, and when would I use it?",
    "Please give me an example that illustrates this passage.",
    "How does this compare with the module in the reference above?",
    "What are the pitfalls of the behaviour described here?",
    "Could you summarize this passage and list its key terms?",
)

SYSTEM_INTRO = (
    "You are a patient and precise assistant for Python programmers. Answer questions about the "
    "standard library using the reference documentation below. Quote it when it helps, say so "
    "when it does not cover a question, and keep answers short.\n\nReference documentation:\n\n"
)

Template = Literal["auto", "chatml", "plain"]
_SEP = "\n\n"
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_OVERSTRIKE = re.compile(r".\x08")


class TokenizerLike(Protocol):
    """What the workloads need of a tokenizer (a Hugging Face tokenizer fits)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]:
        """Token ids of ``text``."""
        ...


@dataclass(frozen=True)
class Request:
    """One request of a workload, replayed in order.

    ``continues`` names the chat session a request belongs to (its prompt holds the session's
    earlier replies); None for docqa and trace requests.
    """

    workload: str
    name: str
    prompt: list[int]
    max_new_tokens: int
    continues: str | None = None


@dataclass(frozen=True)
class ChatTurn:
    """One chat turn: the tokens it appends to its session's history (reply not included).

    For turn 1 ``tokens`` is system prompt + user message + assistant header; for a later turn
    it is the end-of-reply marker (if the template has one) + user message + assistant header.
    ``system_tokens`` is the length of the system-prompt block all sessions share.
    """

    session: str
    turn: int
    name: str
    tokens: list[int]
    max_new_tokens: int
    system_tokens: int


class ChatSession:
    """History of one chat session: ``prompt_for`` a turn, then ``add_reply`` the model's answer.

    Turns must come in order (1, 2, ...), each followed by exactly one ``add_reply``.
    ``prompt_for`` may be called repeatedly for the pending turn and returns the same prompt.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._history: list[int] = []
        self._turns = 0
        self._pending: ChatTurn | None = None

    @property
    def history(self) -> list[int]:
        """Tokens of every finished turn, replies included (a copy)."""
        return list(self._history)

    @property
    def turns_done(self) -> int:
        """Turns whose reply has been added."""
        return self._turns

    def prompt_for(self, turn: ChatTurn) -> list[int]:
        """The prompt of ``turn``: the history so far plus the turn's tokens.

        Raises ValueError if ``turn`` belongs to another session, is out of order, or another
        turn still waits for its reply.
        """
        if turn.session != self.name:
            raise ValueError(f"turn {turn.name!r} belongs to session {turn.session!r}, "
                             f"not {self.name!r}")
        if self._pending is not None and self._pending != turn:
            raise ValueError(f"{self._pending.name!r} still waits for its reply "
                             f"(add_reply) before {turn.name!r}")
        if turn.turn != self._turns + 1:
            raise ValueError(f"{turn.name!r} out of order: session {self.name!r} has finished "
                             f"{self._turns} turn(s)")
        self._pending = turn
        return self._history + turn.tokens

    def request_for(self, turn: ChatTurn) -> Request:
        """``prompt_for(turn)`` as a :class:`Request` (``continues`` = this session's name)."""
        return Request(workload="chat", name=turn.name, prompt=self.prompt_for(turn),
                       max_new_tokens=turn.max_new_tokens, continues=self.name)

    def add_reply(self, tokens: Sequence[int]) -> None:
        """Append the pending turn and the model's reply ``tokens`` to the history.

        Pass the generated tokens as they are (the next turn starts with the template's
        end-of-reply marker). Raises ValueError if no turn is pending.
        """
        if self._pending is None:
            raise ValueError(f"session {self.name!r}: add_reply without a pending turn")
        self._history += self._pending.tokens
        self._history += [int(t) for t in tokens]
        self._pending = None
        self._turns += 1


class ChatStream:
    """Chat turns as :class:`Request` objects with full prompts; ``reply`` feeds answers back.

    Iterate, generate for each request, and call ``reply(request, tokens)`` before taking the
    next request. One stream is one replay: make a new stream for the next one.
    """

    workload = "chat"

    def __init__(self, turns: Sequence[ChatTurn]) -> None:
        self.turns = list(turns)
        self.sessions: dict[str, ChatSession] = {}

    def __iter__(self) -> Iterator[Request]:
        for turn in self.turns:
            session = self.sessions.setdefault(turn.session, ChatSession(turn.session))
            yield session.request_for(turn)

    def reply(self, request: Request, tokens: Sequence[int]) -> None:
        """Append the model's reply to the session of ``request``."""
        if request.continues is None or request.continues not in self.sessions:
            raise ValueError(f"{request.name!r} is not a request of this chat stream")
        self.sessions[request.continues].add_reply(tokens)

    def peek(self) -> list[Request]:
        """The requests with every reply taken as empty: for counting and sizing, not replay."""
        out: list[Request] = []
        sessions: dict[str, ChatSession] = {}
        for turn in self.turns:
            session = sessions.setdefault(turn.session, ChatSession(turn.session))
            out.append(session.request_for(turn))
            session.add_reply([])
        return out


class RequestList:
    """A fixed list of requests (docqa, trace) with the stream interface; ``reply`` is a no-op."""

    def __init__(self, workload: str, requests: Sequence[Request]) -> None:
        self.workload = workload
        self.requests = list(requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def reply(self, request: Request, tokens: Sequence[int]) -> None:
        """Nothing to feed back: prompts do not depend on replies."""

    def peek(self) -> list[Request]:
        """The requests."""
        return list(self.requests)


# --------------------------------------------------------------------------------------------
# Text source


def _clean(text: str) -> str:
    """Drop backspace overstrikes, memory addresses and trailing spaces."""
    text = _OVERSTRIKE.sub("", text)
    text = _ADDRESS.sub("", text)
    return "\n".join(line.rstrip() for line in text.splitlines()).strip()


def _member_docs(obj: Any) -> list[str]:
    """Docstrings of a class's own public methods and properties, by name."""
    out: list[str] = []
    for name, value in sorted(vars(obj).items()):
        if name.startswith("_"):
            continue
        if inspect.isroutine(value) or isinstance(value, property | staticmethod | classmethod):
            doc = inspect.getdoc(value)
            if doc:
                out.append(f"{obj.__name__}.{name}: {doc}")
    return out


@functools.cache
def module_text(name: str) -> str:
    """Documentation of stdlib module ``name``: its docstring, then those of its public classes
    (with their methods) and functions. Starts with the module name; deterministic."""
    module = importlib.import_module(name)
    public = getattr(module, "__all__", None)
    names = list(public) if public is not None else sorted(
        n for n in dir(module) if not n.startswith("_"))
    parts = [f"{name} module", inspect.getdoc(module) or ""]
    for member in names:
        obj = getattr(module, member, None)
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        doc = inspect.getdoc(obj)
        if doc:
            parts.append(f"{name}.{member}\n{doc}")
        if inspect.isclass(obj):
            parts.extend(_member_docs(obj))
    return _clean(_SEP.join(p for p in parts if p))


def reference_texts() -> list[tuple[str, str]]:
    """(module name, documentation text) for every module of :data:`MODULES`."""
    return [(name, module_text(name)) for name in MODULES]


def _paragraphs() -> list[str]:
    """Every paragraph of the reference texts with at least 40 characters, in order."""
    return [p for _, text in reference_texts() for p in text.split(_SEP) if len(p) >= 40]


def _encode(tokenizer: TokenizerLike, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def _fill(tokenizer: TokenizerLike, pieces: Iterator[str], target: int, what: str) -> list[int]:
    """Concatenate the tokens of ``pieces`` (joined by blank lines) and truncate to ``target``."""
    out: list[int] = []
    first = True
    for piece in pieces:
        out += _encode(tokenizer, piece if first else _SEP + piece)
        first = False
        if len(out) >= target:
            return out[:target]
    raise ValueError(f"not enough reference text for {what} of {target} tokens "
                     f"(got {len(out)}); are docstrings stripped (python -OO)?")


# --------------------------------------------------------------------------------------------
# Chat


@dataclass(frozen=True)
class _Markup:
    """Token pieces that frame the messages of a chat."""

    system_open: list[int]
    system_close: list[int]
    user_open: list[int]
    user_close: list[int]   # closes the user message and opens the assistant's reply
    reply_close: list[int]  # closes the assistant's reply (starts the next turn)


def _markup(tokenizer: TokenizerLike, template: Template) -> _Markup:
    if template == "auto":
        chat_template = getattr(tokenizer, "chat_template", None)
        chatml = isinstance(chat_template, str) and "<|im_start|>" in chat_template
        template = "chatml" if chatml else "plain"
    if template == "chatml":
        start = _encode(tokenizer, "<|im_start|>")
        end = _encode(tokenizer, "<|im_end|>")
        if len(start) != 1 or len(end) != 1:
            raise ValueError("template 'chatml' needs <|im_start|> and <|im_end|> to be single "
                             "tokens of this tokenizer")
        newline = _encode(tokenizer, "\n")
        return _Markup(
            system_open=start + _encode(tokenizer, "system\n"),
            system_close=end + newline,
            user_open=start + _encode(tokenizer, "user\n"),
            user_close=end + newline + start + _encode(tokenizer, "assistant\n"),
            reply_close=end + newline)
    if template == "plain":
        return _Markup(system_open=[], system_close=[], user_open=_encode(tokenizer, "\n\nUser: "),
                       user_close=_encode(tokenizer, "\n\nAssistant:"), reply_close=[])
    raise ValueError(f"unknown template {template!r}; use 'auto', 'chatml' or 'plain'")


def chat_requests(tokenizer: TokenizerLike, *, sessions: int = 3, turns: int = 3,
                  system_tokens: int = 1024, user_tokens: int = 64, max_new_tokens: int = 24,
                  seed: int = 0, template: Template = "auto") -> list[ChatTurn]:
    """Multi-turn chat turns, sessions interleaved round-robin (s1 t1, s2 t1, ..., s1 t2, ...).

    All sessions share one system prompt whose text is exactly ``system_tokens`` tokens; every
    user message's text is exactly ``user_tokens`` tokens (role markup comes on top). Turns hold
    only the tokens they add: replay them through :class:`ChatSession` (or :class:`ChatStream`),
    which puts each reply into the next turn's prompt.

    ``template``: ``"chatml"`` frames messages with ``<|im_start|>role ... <|im_end|>`` (what
    SmolLM2-Instruct uses), ``"plain"`` with ``User:`` / ``Assistant:`` lines, ``"auto"`` picks
    chatml when the tokenizer's chat template uses it. Same arguments, same token ids.
    """
    for label, value in (("sessions", sessions), ("turns", turns),
                         ("system_tokens", system_tokens), ("user_tokens", user_tokens),
                         ("max_new_tokens", max_new_tokens)):
        if value < 1:
            raise ValueError(f"{label} must be >= 1, got {value}")
    markup = _markup(tokenizer, template)
    rng = random.Random(f"kvpool-demo-chat-{seed}")
    order = list(MODULES)
    rng.shuffle(order)
    intro = _encode(tokenizer, SYSTEM_INTRO)
    body: list[int] = []
    if system_tokens > len(intro):
        body = _fill(tokenizer, (module_text(m) for m in order), system_tokens - len(intro),
                     "the system prompt")
    system = markup.system_open + (intro + body)[:system_tokens] + markup.system_close
    paragraphs = _paragraphs()
    base = rng.randrange(len(USER_OPENERS))
    out: list[ChatTurn] = []
    for t in range(1, turns + 1):
        for s in range(1, sessions + 1):
            # Consecutive openers, so the sessions of one turn do not start alike.
            opener = USER_OPENERS[(base + len(out)) % len(USER_OPENERS)]
            first = rng.randrange(len(paragraphs))
            excerpt = (paragraphs[(first + k) % len(paragraphs)] for k in range(len(paragraphs)))
            user = _fill(tokenizer, _chain(opener, excerpt), user_tokens, "a user message")
            message = markup.user_open + user + markup.user_close
            tokens = system + message if t == 1 else markup.reply_close + message
            out.append(ChatTurn(session=f"s{s}", turn=t, name=f"chat s{s} t{t}", tokens=tokens,
                                max_new_tokens=max_new_tokens, system_tokens=len(system)))
    return out


def _chain(first: str, rest: Iterator[str]) -> Iterator[str]:
    yield first
    yield from rest


# --------------------------------------------------------------------------------------------
# Document QA


def _doc_label(index: int) -> str:
    """A, B, ..., Z, AA, AB, ..."""
    label = ""
    index += 1
    while index:
        index, rem = divmod(index - 1, 26)
        label = chr(ord("A") + rem) + label
    return label


def docqa_requests(tokenizer: TokenizerLike, *, doc_tokens: Sequence[int] = (3500, 6000),
                   questions: int = 2, max_new_tokens: int = 24,
                   seed: int = 0) -> list[Request]:
    """Long-document QA: one document per entry of ``doc_tokens`` with exactly that many tokens,
    ``questions`` questions on each, interleaved (doc A q1, doc B q1, doc A q2, doc B q2, ...).

    Prompt = document tokens + question tokens (``"\\n\\nQuestion: ...\\nAnswer:"``), so the
    questions on one document share it as prefix. Document *i* starts with the documentation of
    a different module than every other document (no shared prefix) and continues with every
    n-th module of a seeded order (n = number of documents), so documents share no text.
    Same arguments, same token ids.
    """
    if not doc_tokens:
        raise ValueError("doc_tokens must name at least one document length")
    if any(n < 1 for n in doc_tokens):
        raise ValueError(f"document lengths must be >= 1, got {tuple(doc_tokens)}")
    if questions < 1 or max_new_tokens < 1:
        raise ValueError("questions and max_new_tokens must be >= 1")
    ndocs = len(doc_tokens)
    if ndocs > len(MODULES):
        raise ValueError(f"at most {len(MODULES)} documents, got {ndocs}")
    rng = random.Random(f"kvpool-demo-docqa-{seed}")
    order = list(MODULES)
    rng.shuffle(order)
    docs: list[list[int]] = []
    for i, target in enumerate(doc_tokens):
        mine = [order[j] for j in range(i, len(order), ndocs)]
        docs.append(_fill(tokenizer, (module_text(m) for m in mine), target,
                          f"document {_doc_label(i)}"))
    picks = rng.sample(range(len(QUESTIONS)), k=len(QUESTIONS))
    out: list[Request] = []
    for q in range(questions):
        for i, doc in enumerate(docs):
            question = QUESTIONS[picks[(q + i) % len(picks)]]
            tail = _encode(tokenizer, f"\n\nQuestion: {question}\nAnswer:")
            out.append(Request(workload="docqa", name=f"doc {_doc_label(i)} q{q + 1}",
                               prompt=doc + tail, max_new_tokens=max_new_tokens))
    return out


# --------------------------------------------------------------------------------------------
# Trace replay


@dataclass(frozen=True)
class _TraceRow:
    line: int
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_row(raw: str, line: int, where: str) -> _TraceRow:
    at = f"{where} line {line}"
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{at}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{at}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids")
               if k not in obj]
    if missing:
        raise ValueError(f"{at}: missing field(s) {', '.join(missing)}")
    ts, inp, outp, ids = (obj["timestamp"], obj["input_length"], obj["output_length"],
                          obj["hash_ids"])
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise ValueError(f"{at}: timestamp must be a number, got {ts!r}")
    if not _is_int(inp) or inp < 1:
        raise ValueError(f"{at}: input_length must be an integer >= 1, got {inp!r}")
    if not _is_int(outp) or outp < 0:
        raise ValueError(f"{at}: output_length must be an integer >= 0, got {outp!r}")
    if not isinstance(ids, list) or not ids:
        raise ValueError(f"{at}: hash_ids must be a non-empty list, got {ids!r}")
    bad = next((h for h in ids if not _is_int(h) or h < 0), None)
    if bad is not None:
        raise ValueError(f"{at}: hash_ids must be integers >= 0, got {bad!r}")
    return _TraceRow(line=line, timestamp=float(ts), input_length=inp, output_length=outp,
                     hash_ids=[int(h) for h in ids])


def _read_trace(path: Path) -> list[_TraceRow]:
    """Every request of the trace (blank lines skipped); ValueError names a malformed line."""
    rows: list[_TraceRow] = []
    with path.open(encoding="utf-8") as f:
        for line, raw in enumerate(f, start=1):
            if raw.strip():
                rows.append(_parse_row(raw, line, path.name))
    if not rows:
        raise ValueError(f"{path.name}: the trace holds no requests")
    return rows


def trace_requests(path: Path | str, tokenizer_vocab_size: int, *, block_tokens: int = 32,
                   max_prompt_tokens: int = 4096, max_requests: int = 40,
                   max_new_tokens: int = 8, source_block: int = 512, seed: int = 0,
                   start: int = 0, low_token: int = 256,
                   special_ids: Sequence[int] = ()) -> tuple[list[Request], dict[str, Any]]:
    """Replay requests ``start .. start + max_requests`` of a trace, scaled down.

    Every hash id becomes a block of ``block_tokens`` token ids drawn from
    ``numpy.random.default_rng([seed, hash_id])``, uniformly from ``[low_token,
    tokenizer_vocab_size)`` minus ``special_ids``: equal ids give equal blocks. A prompt is the
    concatenation of its blocks, cut to ``ceil(input_length * block_tokens / source_block)``
    tokens (the last block trimmed in proportion); one longer than ``max_prompt_tokens`` keeps
    only the whole blocks that fit. Output length = ``min(output_length, max_new_tokens)``, at
    least 1. Request names are ``"trace #<line number>"``.

    The whole file is validated: a malformed line raises ValueError naming the file and line.
    Returns (requests, scaling), where scaling describes the replay for printing: source and
    scaled block sizes, scale, caps, request counts, unique blocks, reused blocks (blocks seen
    in an earlier replayed request, i.e. the cache's opportunity) and prompt tokens.
    """
    for label, value in (("tokenizer_vocab_size", tokenizer_vocab_size),
                         ("block_tokens", block_tokens), ("max_requests", max_requests),
                         ("max_new_tokens", max_new_tokens), ("source_block", source_block)):
        if value < 1:
            raise ValueError(f"{label} must be >= 1, got {value}")
    if max_prompt_tokens < block_tokens:
        raise ValueError(f"max_prompt_tokens ({max_prompt_tokens}) must hold at least one "
                         f"block of {block_tokens} tokens")
    if start < 0 or low_token < 0:
        raise ValueError("start and low_token must be >= 0")
    specials = np.asarray(sorted(set(special_ids)), dtype=np.int64)
    allowed = np.setdiff1d(np.arange(low_token, tokenizer_vocab_size, dtype=np.int64), specials)
    if allowed.size < 2:
        raise ValueError(f"no token ids left in [{low_token}, {tokenizer_vocab_size}) "
                         "without the special ids")
    trace = Path(path)
    rows = _read_trace(trace)
    chosen = rows[start:start + max_requests]
    if not chosen:
        raise ValueError(f"{trace.name}: start {start} is past the last of {len(rows)} requests")

    blocks: dict[int, list[int]] = {}

    def block(hash_id: int) -> list[int]:
        if hash_id not in blocks:
            rng = np.random.default_rng([seed, hash_id])
            blocks[hash_id] = allowed[rng.integers(0, allowed.size, block_tokens)].tolist()
        return blocks[hash_id]

    whole_cap = (max_prompt_tokens // block_tokens) * block_tokens
    requests: list[Request] = []
    seen: set[int] = set()
    reused = capped = prompt_tokens = 0
    for row in chosen:
        length = -(-row.input_length * block_tokens // source_block)
        length = max(1, min(length, len(row.hash_ids) * block_tokens))
        if length > max_prompt_tokens:
            length = whole_cap
            capped += 1
        nblocks = -(-length // block_tokens)
        ids = row.hash_ids[:nblocks]
        prompt = [t for h in ids for t in block(h)][:length]
        reused += sum(1 for h in ids if h in seen)
        seen.update(ids)
        prompt_tokens += len(prompt)
        requests.append(Request(workload="trace", name=f"trace #{row.line}", prompt=prompt,
                                max_new_tokens=max(1, min(row.output_length, max_new_tokens))))
    scaling: dict[str, Any] = {
        "trace": trace.name,
        "source_block_tokens": source_block,
        "block_tokens": block_tokens,
        "scale": block_tokens / source_block,
        "max_prompt_tokens": max_prompt_tokens,
        "max_new_tokens": max_new_tokens,
        "start": start,
        "requests": len(requests),
        "trace_requests": len(rows),
        "capped_requests": capped,
        "unique_blocks": len(seen),
        "reused_blocks": reused,
        "prompt_tokens": prompt_tokens,
        "seed": seed,
    }
    return requests, scaling


# --------------------------------------------------------------------------------------------
# Presets and the demo's entry point


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

    Reads ``args.quick``, ``args.workloads``, ``args.trace``, ``args.trace_requests`` and
    ``args.chunk_tokens`` (None: DEMO_CHUNK_TOKENS, or the scaled trace block with
    ``--trace``).
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
