"""Request workloads for ``kvpool demo``, built as token ids.

Three workloads, each a list of requests replayed in order:

* **chat** (:func:`chat_requests`, :mod:`.chat`): several sessions share one long system
  prompt; every turn appends a user message to its session's history, and the model's reply to
  turn *t* becomes part of turn *t+1*'s prompt. Built as :class:`ChatTurn` objects replayed
  through a :class:`ChatSession` per session, or a :class:`ChatStream`.
* **docqa** (:func:`docqa_requests`, :mod:`.docqa`): long documents, several questions each,
  interleaved (doc A q1, doc B q1, doc A q2, ...); prompt = document tokens + question tokens,
  so the questions on one document share the document as prefix.
* **trace** (:func:`trace_requests`, :mod:`.trace`): a request trace in the format of
  ``shared/traces``, scaled down so that a CPU can run it.

Text comes from the Python standard library's own documentation (:mod:`.text`), and token
sequences are built by concatenating the tokens of text pieces and truncating at token level,
never by re-tokenizing a whole prompt, so shared prefixes are exact. :mod:`.request` holds
:class:`Request` and :class:`RequestList`; :mod:`.presets` the workload sizes and the demo's
entry point :func:`build_streams`.
"""

from kvpool.demo.workloads.chat import ChatSession, ChatStream, ChatTurn, chat_requests
from kvpool.demo.workloads.docqa import QUESTIONS, docqa_requests
from kvpool.demo.workloads.presets import (
    DEFAULT,
    DEMO_CHUNK_TOKENS,
    QUICK,
    ChatParams,
    DocQAParams,
    Preset,
    TraceParams,
    build_streams,
)
from kvpool.demo.workloads.request import Request, RequestList
from kvpool.demo.workloads.text import MODULES, TokenizerLike, module_text, reference_texts
from kvpool.demo.workloads.trace import trace_requests

__all__ = [
    "DEFAULT",
    "DEMO_CHUNK_TOKENS",
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
