"""The text source of the workloads: the Python standard library's own documentation.

Text comes from the Python standard library's own documentation (``inspect.getdoc`` of a fixed
list of modules, their public classes, functions and methods): real English, offline, and the
same on the same Python version. Token sequences are built by concatenating
``tokenizer.encode(piece, add_special_tokens=False)`` of text pieces and truncating at token
level, never by re-tokenizing a whole prompt, so shared prefixes are exact.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from collections.abc import Iterator
from typing import Any, Protocol

__all__ = ["MODULES", "TokenizerLike", "module_text", "reference_texts"]

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

_SEP = "\n\n"
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_OVERSTRIKE = re.compile(r".\x08")


class TokenizerLike(Protocol):
    """What the workloads need of a tokenizer (a Hugging Face tokenizer fits)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]:
        """Token ids of ``text``."""
        ...


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

