"""The HTTP endpoint of a process's metrics: ``/metrics`` (prometheus-client's exposition)
and, for a storage node, its other pages (``/healthz``, ``/readyz``, ``/sd``), on a thread.
Any other path is 404."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.registry import CollectorRegistry

log = logging.getLogger(__name__)

#: An HTTP page: status code, content type and body.
Page = tuple[int, str, bytes]
#: Answers one path at request time (on the server's thread); an exception it raises is a
#: 500 answer, logged rate-free at WARNING (a bug, not load).
PageHandler = Callable[[], Page]
#: Answers a request with its method and body (the query API's POSTs); same contract.
RequestHandler = Callable[[str, bytes], Page]
#: Largest request body read; a larger one is answered 413 unread.
MAX_BODY_BYTES = 16 << 20

_REASONS = {200: "200 OK", 400: "400 Bad Request", 404: "404 Not Found",
            413: "413 Content Too Large", 500: "500 Internal Server Error",
            503: "503 Service Unavailable"}


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Quiet(WSGIRequestHandler):
    """No access log on stderr (a scrape a second would flood it)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class MetricsServer:
    """Serves ``registry`` at http://host:port/metrics and each of ``pages`` (path ->
    handler) at its path until ``close``; every other path is 404. Raises OSError when the
    port cannot be bound (taken, no permission): a port set in the config that cannot be
    served is an error at start, never a silent gap in monitoring."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int,
                 pages: Mapping[str, PageHandler] | None = None,
                 requests: Mapping[str, RequestHandler] | None = None) -> None:
        self._metrics = make_wsgi_app(registry)
        self._pages = dict(pages or {})
        self._requests = dict(requests or {})
        server_class = _Server6 if ":" in host else _Server
        self._server: Any = make_server(host, port, self._app, server_class, _Quiet)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="kvpool-metrics-http", daemon=True)
        self._thread.start()
        self.host = host
        self.port: int = self._server.server_port
        log.info("metrics at http://%s:%d/metrics", host, self.port,
                 extra={"event": "metrics_listening", "port": self.port})

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def _app(self, environ: dict[str, Any],
             start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        if path == "/metrics":
            answer: Iterable[bytes] = self._metrics(environ, start_response)
            return answer
        handler = self._pages.get(path)
        request = self._requests.get(path)
        if handler is None and request is None:
            known = " ".join(["/metrics", *sorted(self._pages), *sorted(self._requests)])
            code, ctype, body = 404, "text/plain", f"not found; try {known}\n".encode()
        else:
            try:
                if request is not None:
                    code, ctype, body = _call(request, environ)
                else:
                    assert handler is not None
                    code, ctype, body = handler()
            except Exception as exc:  # a bug in a page: answered, never the server's end
                log.warning("metrics endpoint: %s failed: %s", path, exc,
                            extra={"event": "http_page_failed", "path": path})
                code, ctype, body = 500, "text/plain", f"{exc}\n".encode()
        start_response(_REASONS.get(code, f"{code} Status"),
                       [("Content-Type", ctype), ("Content-Length", str(len(body)))])
        return [body]

    def close(self) -> None:
        """Stop serving. Idempotent."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = None


def _call(request: RequestHandler, environ: dict[str, Any]) -> Page:
    """Read the body (at most MAX_BODY_BYTES: else 413 unread) and call the handler."""
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return 400, "text/plain", b"bad Content-Length\n"
    if length > MAX_BODY_BYTES:
        return 413, "text/plain", f"body over {MAX_BODY_BYTES} bytes\n".encode()
    body = environ["wsgi.input"].read(length) if length > 0 else b""
    return request(environ.get("REQUEST_METHOD", "GET"), body)
