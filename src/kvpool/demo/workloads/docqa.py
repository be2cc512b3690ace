"""The docqa workload: questions on long documents, interleaved.

Long documents, several questions each, interleaved (doc A q1, doc B q1, doc A q2, ...);
prompt = document tokens + question tokens, so the questions on one document share the
document as prefix.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvpool.demo.workloads.request import Request
from kvpool.demo.workloads.text import MODULES, TokenizerLike, _encode, _fill, module_text

__all__ = ["QUESTIONS", "docqa_requests"]

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
