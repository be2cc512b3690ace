"""A request of a workload, and a fixed list of them with the stream interface."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["Request", "RequestList"]


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
