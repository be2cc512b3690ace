"""One open etcd ``/v3/watch`` stream, read with a deadline and closable from any thread.

:meth:`kvpool.cluster.etcd.EtcdClient.watch` opens it on the first endpoint that accepts it.
Failure model: connecting and the response headers are bounded by ``timeout_s``; a read
returns None when nothing arrived in time (the stream stays usable); the stream ending,
failing, being closed, or carrying an etcd error raises :class:`EtcdError`.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from typing import Any

from kvpool.cluster.etcd_wire import (
    Endpoint,
    EtcdError,
    Event,
    WatchResponse,
    describe,
    error_message,
    header_revision,
    key_value,
    to_int,
)

__all__ = ["WatchStream"]


class WatchStream:
    """One open ``/v3/watch`` stream: newline-delimited JSON over HTTP/1.1 chunked encoding.

    Read with :meth:`next` from one thread; :meth:`close` may be called from any thread and
    makes a blocked :meth:`next` return (raising EtcdError) at once. The socket is our own
    rather than http.client's, so that a read timeout leaves the stream usable.
    """

    def __init__(self, endpoint: Endpoint, body: bytes, timeout_s: float) -> None:
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
            raise EtcdError(f"{endpoint.url}: {describe(exc)}", endpoint=None) from exc
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
            raise EtcdError(f"{endpoint.url}: watch: {describe(exc)}") from exc
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
            raise EtcdError(f"etcd {self.endpoint} watch: {describe(exc)}",
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
            message, code = error_message(doc, body)
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
            message, code = error_message(doc, line)
            raise EtcdError(f"etcd {self.endpoint} watch failed: {message}",
                            endpoint=self.endpoint, code=code)
        result = doc.get("result") or {}
        events = tuple(
            Event(type=str(ev.get("type") or "PUT"), kv=key_value(ev.get("kv") or {}))
            for ev in result.get("events") or []
        )
        return WatchResponse(
            revision=header_revision(result),
            events=events,
            created=bool(result.get("created")),
            canceled=bool(result.get("canceled")),
            compact_revision=to_int(result.get("compact_revision")),
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
