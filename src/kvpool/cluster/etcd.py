"""A small client for etcd v3's JSON gateway (the HTTP/JSON face of the gRPC API).

Stdlib only. It covers what membership needs: put / range / delete, leases (grant, keepalive,
revoke) and a streaming watch. Keys and values are bytes (str keys are UTF-8 encoded); the
gateway carries them base64-encoded and int64 fields as strings, which this module hides.

Failure model, the same for every call:

- every socket operation has a timeout (``timeout_s``, per endpoint tried);
- on a transport failure (refused, reset, timed out, not HTTP) or an etcd "unavailable" answer
  the call is tried on the next endpoint; the endpoint that last worked is tried first;
- when no endpoint answers, or etcd answers with an error, :class:`EtcdError` is raised with
  the endpoint(s), the gateway path and what went wrong.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvpool.errors import KVPoolError

__all__ = [
    "EtcdClient",
    "EtcdError",
    "Event",
    "KeyValue",
    "WatchResponse",
    "WatchStream",
    "prefix_range_end",
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
class _Endpoint:
    url: str
    host: str
    port: int


def _parse_endpoint(endpoint: str) -> _Endpoint:
    """``http://host:port`` (or bare ``host:port``) → _Endpoint; ValueError if malformed."""
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
    return _Endpoint(url=f"http://{shown}:{port}", host=host, port=port)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _as_bytes(key: bytes | str) -> bytes:
    return key.encode("utf-8") if isinstance(key, str) else bytes(key)


def prefix_range_end(prefix: bytes | str) -> bytes:
    """The ``range_end`` that makes a range or watch cover every key starting with ``prefix``."""
    data = bytearray(_as_bytes(prefix))
    while data:
        if data[-1] < 0xFF:
            data[-1] += 1
            return bytes(data)
        data.pop()
    return b"\x00"  # empty prefix (or all 0xff): etcd reads "\0" as "to the end"


def _int(value: Any) -> int:
    return int(value) if value not in (None, "") else 0


def _kv(doc: JSONDict) -> KeyValue:
    return KeyValue(
        key=_unb64(doc.get("key")),
        value=_unb64(doc.get("value")),
        create_revision=_int(doc.get("create_revision")),
        mod_revision=_int(doc.get("mod_revision")),
        version=_int(doc.get("version")),
        lease=_int(doc.get("lease")),
    )


def _revision(doc: JSONDict) -> int:
    header = doc.get("header") or {}
    return _int(header.get("revision"))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text


def _error_message(doc: Any, raw: bytes) -> tuple[str, int | None]:
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


class EtcdClient:
    """Calls etcd's v3 JSON gateway on one of ``endpoints`` (``["http://127.0.0.1:2379"]``).

    Thread-safe: every call opens its own connection. Raises ValueError for a malformed or
    empty endpoint list, :class:`EtcdError` from calls as described in the module docstring.
    """

    def __init__(self, endpoints: Sequence[str], timeout_s: float = 2.0) -> None:
        if isinstance(endpoints, str):
            endpoints = [endpoints]
        if not endpoints:
            raise ValueError("etcd: no endpoints given")
        if timeout_s <= 0:
            raise ValueError("etcd: timeout_s must be > 0")
        self._endpoints = [_parse_endpoint(e) for e in endpoints]
        self.timeout_s = float(timeout_s)
        self._lock = threading.Lock()
        self._preferred = 0

    @property
    def endpoints(self) -> list[str]:
        """The endpoints, normalised to ``http://host:port``."""
        return [e.url for e in self._endpoints]

    def _order(self) -> list[int]:
        with self._lock:
            first = self._preferred
        n = len(self._endpoints)
        return [(first + i) % n for i in range(n)]

    def _worked(self, index: int) -> None:
        with self._lock:
            self._preferred = index

    # -- unary calls ------------------------------------------------------------------------

    def call(self, path: str, body: JSONDict) -> JSONDict:
        """POST ``body`` to gateway ``path`` (e.g. ``/v3/kv/range``); the decoded answer.

        Raises EtcdError when no endpoint answers or etcd reports an error.
        """
        payload = json.dumps(body).encode("utf-8")
        failures: list[str] = []
        for index in self._order():
            ep = self._endpoints[index]
            conn = http.client.HTTPConnection(ep.host, ep.port, timeout=self.timeout_s)
            try:
                conn.request("POST", path, body=payload,
                             headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                raw = resp.read()
                status = resp.status
            except (OSError, http.client.HTTPException) as exc:
                failures.append(f"{ep.url}: {_describe(exc)}")
                continue
            finally:
                conn.close()
            try:
                doc: Any = json.loads(raw) if raw else {}
            except ValueError:
                doc = None
            if status == 200 and isinstance(doc, dict) and "error" not in doc:
                self._worked(index)
                result = doc.get("result")  # streaming endpoints (keepalive) wrap the answer
                return result if isinstance(result, dict) else doc
            message, code = _error_message(doc, raw)
            if not isinstance(doc, dict):
                failures.append(f"{ep.url}: HTTP {status}, not an etcd v3 JSON gateway "
                                f"answer: {message!r}")
                continue
            if code == GRPC_UNAVAILABLE:
                failures.append(f"{ep.url}: {message}")
                continue
            raise EtcdError(f"etcd {ep.url} {path} failed: {message}", endpoint=ep.url,
                            code=code)
        raise EtcdError(f"etcd unreachable ({path}): " + "; ".join(failures))

    def put(self, key: bytes | str, value: bytes, lease: int = 0) -> int:
        """Store ``value`` at ``key`` (attached to ``lease`` if non-zero); the new revision."""
        body: JSONDict = {"key": _b64(_as_bytes(key)), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return _revision(self.call("/v3/kv/put", body))

    def range(self, key: bytes | str, range_end: bytes | None = None, *,
              count_only: bool = False, limit: int = 0) -> tuple[list[KeyValue], int]:
        """Keys in ``[key, range_end)`` (just ``key`` when ``range_end`` is None), and the
        store revision they were read at."""
        body: JSONDict = {"key": _b64(_as_bytes(key))}
        if range_end is not None:
            body["range_end"] = _b64(range_end)
        if count_only:
            body["count_only"] = True
        if limit:
            body["limit"] = str(limit)
        doc = self.call("/v3/kv/range", body)
        return [_kv(kv) for kv in doc.get("kvs") or []], _revision(doc)

    def get(self, key: bytes | str) -> KeyValue | None:
        """The key's current value, or None if it does not exist."""
        kvs, _ = self.range(key)
        return kvs[0] if kvs else None

    def get_prefix(self, prefix: bytes | str) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` (sorted by key) and the revision they were read at."""
        return self.range(prefix, prefix_range_end(prefix))

    def delete(self, key: bytes | str, range_end: bytes | None = None) -> int:
        """Delete ``key`` (or ``[key, range_end)``); how many keys were deleted."""
        body: JSONDict = {"key": _b64(_as_bytes(key))}
        if range_end is not None:
            body["range_end"] = _b64(range_end)
        return _int(self.call("/v3/kv/deleterange", body).get("deleted"))

    def delete_prefix(self, prefix: bytes | str) -> int:
        """Delete every key under ``prefix``; how many were deleted."""
        return self.delete(prefix, prefix_range_end(prefix))

    def lease_grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: ``(lease_id, ttl_s)``. etcd may raise a small TTL to its minimum."""
        doc = self.call("/v3/lease/grant", {"TTL": str(int(ttl_s))})
        lease_id = _int(doc.get("ID"))
        if not lease_id:
            raise EtcdError(f"etcd lease grant returned no lease id: {doc}")
        return lease_id, _int(doc.get("TTL"))

    def lease_keepalive(self, lease_id: int) -> int:
        """Refresh the lease once; its remaining TTL in seconds, 0 if the lease is gone."""
        return _int(self.call("/v3/lease/keepalive", {"ID": str(lease_id)}).get("TTL"))

    def lease_revoke(self, lease_id: int) -> bool:
        """Revoke the lease, deleting its keys at once; False if it did not exist."""
        try:
            self.call("/v3/lease/revoke", {"ID": str(lease_id)})
        except EtcdError as exc:
            if exc.code == GRPC_NOT_FOUND:
                return False
            raise
        return True

    def health(self) -> int:
        """A cheap linearizable read (fails without a quorum); the current revision."""
        return self.range(b"\x00", count_only=True)[1]

    # -- watch --------------------------------------------------------------------------------

    def watch(self, key: bytes | str, range_end: bytes | None = None,
              start_revision: int = 0) -> WatchStream:
        """Open a watch on ``[key, range_end)`` from ``start_revision`` (0 = from now).

        Connects to the first endpoint that accepts the stream; raises EtcdError if none does.
        The stream's first message has ``created=True``.
        """
        create: JSONDict = {"key": _b64(_as_bytes(key))}
        if range_end is not None:
            create["range_end"] = _b64(range_end)
        if start_revision:
            create["start_revision"] = str(start_revision)
        body = json.dumps({"create_request": create}).encode("utf-8")
        failures: list[str] = []
        for index in self._order():
            ep = self._endpoints[index]
            try:
                stream = WatchStream(ep, body, self.timeout_s)
            except EtcdError as exc:
                failures.append(str(exc))
                if exc.code is not None and exc.code != GRPC_UNAVAILABLE:
                    raise
                continue
            self._worked(index)
            return stream
        raise EtcdError("etcd unreachable (/v3/watch): " + "; ".join(failures))

    def watch_prefix(self, prefix: bytes | str, start_revision: int = 0) -> WatchStream:
        """:meth:`watch` on every key under ``prefix``."""
        return self.watch(prefix, prefix_range_end(prefix), start_revision)


class WatchStream:
    """One open ``/v3/watch`` stream: newline-delimited JSON over HTTP/1.1 chunked encoding.

    Read with :meth:`next` from one thread; :meth:`close` may be called from any thread and
    makes a blocked :meth:`next` return (raising EtcdError) at once. The socket is our own
    rather than http.client's, so that a read timeout leaves the stream usable.
    """

    def __init__(self, endpoint: _Endpoint, body: bytes, timeout_s: float) -> None:
        self.endpoint = endpoint.url
        self._timeout_s = timeout_s
        self._closed = False
        self._raw = bytearray()    # bytes received, not yet de-chunked
        self._body = bytearray()   # de-chunked body, not yet split into lines
        self._chunk_left = 0       # bytes of the current chunk still in _raw's future
        self._chunked = True
        self._eof = False
        try:
            self._sock = socket.create_connection((endpoint.host, endpoint.port),
                                                  timeout=timeout_s)
        except OSError as exc:
            raise EtcdError(f"{endpoint.url}: {_describe(exc)}", endpoint=None) from exc
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            host = f"[{endpoint.host}]" if ":" in endpoint.host else endpoint.host
            request = (f"POST /v3/watch HTTP/1.1\r\nHost: {host}:{endpoint.port}\r\n"
                       "Content-Type: application/json\r\n"
                       f"Content-Length: {len(body)}\r\n\r\n").encode("ascii") + body
            self._sock.sendall(request)
            self._read_headers(time.monotonic() + timeout_s)
        except OSError as exc:
            self.close()
            raise EtcdError(f"{endpoint.url}: watch: {_describe(exc)}") from exc
        except EtcdError:
            self.close()
            raise

    def _recv(self, deadline: float) -> bool:
        """Receive more bytes into _raw; False on timeout. Raises EtcdError on EOF/close."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        if self._closed:
            raise EtcdError(f"etcd {self.endpoint} watch: closed")
        try:
            self._sock.settimeout(remaining)
            data = self._sock.recv(65536)
        except TimeoutError:
            return False
        except OSError as exc:
            if self._closed:
                raise EtcdError(f"etcd {self.endpoint} watch: closed") from exc
            raise EtcdError(f"etcd {self.endpoint} watch: {_describe(exc)}",
                            endpoint=self.endpoint) from exc
        if not data:
            self._eof = True
            reason = "closed" if self._closed else "connection closed by etcd"
            raise EtcdError(f"etcd {self.endpoint} watch: {reason}", endpoint=self.endpoint)
        self._raw += data
        return True

    def _read_headers(self, deadline: float) -> None:
        while b"\r\n\r\n" not in self._raw:
            if len(self._raw) > 65536:
                raise EtcdError(f"etcd {self.endpoint} watch: response headers too large")
            if not self._recv(deadline):
                raise EtcdError(f"etcd {self.endpoint} watch: timed out waiting for the "
                                "response", endpoint=self.endpoint)
        head, _, rest = bytes(self._raw).partition(b"\r\n\r\n")
        self._raw = bytearray(rest)
        lines = head.decode("latin-1").split("\r\n")
        status_parts = lines[0].split(" ", 2)
        if len(status_parts) < 2 or not status_parts[0].startswith("HTTP/"):
            raise EtcdError(f"etcd {self.endpoint} watch: not an HTTP response: "
                            f"{lines[0][:100]!r}", endpoint=self.endpoint)
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        if status_parts[1] != "200":
            body = bytes(self._raw)
            try:
                doc: Any = json.loads(body) if body else None
            except ValueError:
                doc = None
            message, code = _error_message(doc, body)
            raise EtcdError(f"etcd {self.endpoint} /v3/watch failed: HTTP {status_parts[1]}: "
                            f"{message}", endpoint=self.endpoint, code=code)

    def _dechunk(self) -> None:
        """Move whole or partial chunk data from _raw to _body."""
        if not self._chunked:
            self._body += self._raw
            self._raw.clear()
            return
        while self._raw:
            if self._chunk_left == 0:
                end = self._raw.find(b"\r\n")
                if end < 0:
                    return
                size_text = bytes(self._raw[:end]).split(b";", 1)[0].strip()
                if not size_text:  # the CRLF that ends the previous chunk
                    del self._raw[:end + 2]
                    continue
                try:
                    size = int(size_text, 16)
                except ValueError as exc:
                    raise EtcdError(f"etcd {self.endpoint} watch: bad chunk header "
                                    f"{size_text[:20]!r}", endpoint=self.endpoint) from exc
                del self._raw[:end + 2]
                if size == 0:
                    raise EtcdError(f"etcd {self.endpoint} watch: stream ended by etcd",
                                    endpoint=self.endpoint)
                self._chunk_left = size
            take = min(self._chunk_left, len(self._raw))
            self._body += self._raw[:take]
            del self._raw[:take]
            self._chunk_left -= take

    def next(self, timeout_s: float) -> WatchResponse | None:
        """The next message, or None if none arrived within ``timeout_s``.

        Raises EtcdError when the stream ends, the connection fails, the stream was closed, or
        etcd sends an error message.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            newline = self._body.find(b"\n")
            if newline >= 0:
                line = bytes(self._body[:newline]).strip()
                del self._body[:newline + 1]
                if line:
                    return self._parse(line)
                continue
            self._dechunk()
            if b"\n" in self._body:
                continue
            if not self._recv(deadline):
                return None

    def _parse(self, line: bytes) -> WatchResponse:
        try:
            doc = json.loads(line)
        except ValueError as exc:
            raise EtcdError(f"etcd {self.endpoint} watch: bad message {line[:100]!r}",
                            endpoint=self.endpoint) from exc
        if not isinstance(doc, dict):
            raise EtcdError(f"etcd {self.endpoint} watch: bad message {line[:100]!r}",
                            endpoint=self.endpoint)
        if "error" in doc:
            message, code = _error_message(doc, line)
            raise EtcdError(f"etcd {self.endpoint} watch failed: {message}",
                            endpoint=self.endpoint, code=code)
        result = doc.get("result") or {}
        events = tuple(
            Event(type=str(ev.get("type") or "PUT"), kv=_kv(ev.get("kv") or {}))
            for ev in result.get("events") or []
        )
        return WatchResponse(
            revision=_revision(result),
            events=events,
            created=bool(result.get("created")),
            canceled=bool(result.get("canceled")),
            compact_revision=_int(result.get("compact_revision")),
            cancel_reason=str(result.get("cancel_reason") or ""),
        )

    def close(self) -> None:
        """Close the stream; idempotent, callable from any thread."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def __enter__(self) -> WatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
