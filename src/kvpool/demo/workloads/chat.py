"""The chat workload: multi-turn sessions whose prompts hold the model's earlier replies.

Several sessions share one long system prompt; every turn appends a user message to its
session's history, and the model's reply to turn *t* becomes part of turn *t+1*'s prompt.
Replies are only known at run time, so chat is built as :class:`ChatTurn` objects that hold
only the tokens a turn *adds*; a :class:`ChatSession` per session keeps the history::

    sessions: dict[str, ChatSession] = {}
    for turn in chat_requests(tokenizer):
        session = sessions.setdefault(turn.session, ChatSession(turn.session))
        request = session.request_for(turn)      # prompt = history + turn.tokens
        reply = generate(request.prompt, request.max_new_tokens)
        session.add_reply(reply)                 # history = prompt + reply

Every prompt of a session is therefore a strict prefix of the session's next prompt, and all
sessions start with the same system-prompt tokens. :class:`ChatStream` wraps exactly this
loop behind ``__iter__`` / ``reply``. Use fresh sessions (a fresh stream) for every replay.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from kvpool.demo.workloads.request import Request
from kvpool.demo.workloads.text import (
    MODULES,
    TokenizerLike,
    _encode,
    _fill,
    _paragraphs,
    module_text,
)

__all__ = ["ChatSession", "ChatStream", "ChatTurn", "chat_requests"]

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

