"""The ``/metrics`` HTTP endpoint of a process (prometheus-client's WSGI server on a
thread)."""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.registry import CollectorRegistry

log = logging.getLogger(__name__)


class MetricsServer:
    """Serves ``registry`` at http://host:port/metrics until ``close``. Raises OSError when
    the port cannot be bound (taken, no permission): a port set in the config that cannot
    be served is an error at start, never a silent gap in monitoring."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._server: Any
        self._server, self._thread = start_http_server(port, host, registry)
        self.host = host
        self.port: int = self._server.server_port
        log.info("metrics at http://%s:%d/metrics", host, self.port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving. Idempotent."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = None
