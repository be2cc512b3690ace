"""The etcd v3 JSON gateway's wire format: errors, key-values, watch messages, endpoints.

The gateway carries keys and values base64-encoded and int64 fields as strings; the helpers
here turn its JSON into the typed values :mod:`kvpool.cluster.etcd` (unary calls) and
:mod:`kvpool.cluster.etcd_watch` (the watch stream) return, and its error bodies into
``(message, gRPC code)``. Nothing here touches the network.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvpool.errors import KVPoolError

__all__ = [
    "GRPC_NOT_FOUND",
    "GRPC_UNAVAILABLE",
    "Endpoint",
    "EtcdError",
    "Event",
    "JSONDict",
    "KeyValue",
    "WatchResponse",
    "as_bytes",
    "b64",
    "describe",
    "error_message",
    "header_revision",
    "key_value",
    "parse_endpoint",
    "prefix_range_end",
    "to_int",
    "unb64",
]

# gRPC status codes etcd reports in error bodies; only "unavailable" moves on to the next
# endpoint (no leader, member stopping), the rest are answers.
GRPC_NOT_FOUND = 5
GRPC_UNAVAILABLE = 14

JSONDict = dict[str, Any]


class EtcdError(KVPoolError):
    """etcd could not be reached, or answered a request with an error.

    ``endpoint`` is the endpoint that answered (``None`` when none did), ``code`` the gRPC
    status code etcd reported (``None`` for transport failures).
    """

    def __init__(self, message: str, *, endpoint: str | None = None,
                 code: int | None = None) -> None:
        super().__init__(message)
        self.endpoint = endpoint
        self.code = code


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd stores it. ``lease`` is 0 when the key has no lease."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True)
class Event:
    """A watch event: ``type`` is ``"PUT"`` or ``"DELETE"`` (a DELETE's ``kv.value`` is b"")."""

    type: str
    kv: KeyValue


@dataclass(frozen=True)
class WatchResponse:
    """One message of a watch stream.

    ``revision`` is the store revision the message was sent at. ``compact_revision`` is set
    (with ``canceled``) when the requested start revision was already compacted away: the
    watcher must re-read with a range and watch again from the range's revision.
    """

    revision: int
    events: tuple[Event, ...]
    created: bool
    canceled: bool
    compact_revision: int
    cancel_reason: str


@dataclass(frozen=True)
class Endpoint:
    url: str
    host: str
    port: int


def parse_endpoint(endpoint: str) -> Endpoint:
    """``http://host:port`` (or bare ``host:port``) → Endpoint; ValueError if malformed."""
    text = endpoint.strip()
    if "://" not in text:
        text = "http://" + text
    parts = urlsplit(text)
    if parts.scheme != "http":
        raise ValueError(f"etcd endpoint {endpoint!r}: only http:// endpoints are supported")
    if not parts.hostname:
        raise ValueError(f"etcd endpoint {endpoint!r}: no host")
    try:
        port = parts.port or 2379
    except ValueError as exc:
        raise ValueError(f"etcd endpoint {endpoint!r}: bad port") from exc
    if parts.path not in ("", "/"):
        raise ValueError(f"etcd endpoint {endpoint!r}: must not have a path")
    host = parts.hostname
    shown = f"[{host}]" if ":" in host else host
    return Endpoint(url=f"http://{shown}:{port}", host=host, port=port)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def as_bytes(key: bytes | str) -> bytes:
    return key.encode("utf-8") if isinstance(key, str) else bytes(key)


def prefix_range_end(prefix: bytes | str) -> bytes:
    """The ``range_end`` that makes a range or watch cover every key starting with ``prefix``."""
    data = bytearray(as_bytes(prefix))
    while data:
        if data[-1] < 0xFF:
            data[-1] += 1
            return bytes(data)
        data.pop()
    return b"\x00"  # empty prefix (or all 0xff): etcd reads "\0" as "to the end"


def to_int(value: Any) -> int:
    return int(value) if value not in (None, "") else 0


def key_value(doc: JSONDict) -> KeyValue:
    return KeyValue(
        key=unb64(doc.get("key")),
        value=unb64(doc.get("value")),
        create_revision=to_int(doc.get("create_revision")),
        mod_revision=to_int(doc.get("mod_revision")),
        version=to_int(doc.get("version")),
        lease=to_int(doc.get("lease")),
    )


def header_revision(doc: JSONDict) -> int:
    header = doc.get("header") or {}
    return to_int(header.get("revision"))


def describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text


def error_message(doc: Any, raw: bytes) -> tuple[str, int | None]:
    """(message, gRPC code) from a gateway error body, or the raw text if it is not JSON."""
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict):  # streaming endpoints nest the error object
            doc = err
            err = doc.get("message")
        message = doc.get("message") or err or raw[:200].decode("utf-8", "replace")
        code = doc.get("code")
        try:
            return str(message), int(code) if code is not None else None
        except (TypeError, ValueError):
            return str(message), None
    return raw[:200].decode("utf-8", "replace").strip() or "empty body", None
