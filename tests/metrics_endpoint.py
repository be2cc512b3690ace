"""A real ``/metrics`` endpoint for monitor tests: a prometheus_client registry the test fills,
rendered by ``generate_latest`` and served over HTTP on 127.0.0.1 by a thread of the test."""

from __future__ import annotations

import http.server
import socket
import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# The latency buckets every kvpool histogram uses (issue 12's metric list).
BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05,
           0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, float("inf"))


@dataclass
class PoolMetrics:
    """The pool metrics a monitor reads, under their exposed names, in one registry."""

    registry: CollectorRegistry
    lookups: Counter
    hit_chunks: Counter
    miss_chunks: Counter
    read_bytes: Counter
    written_bytes: Counter
    op_seconds: Histogram
    tier_op_seconds: Histogram
    evictions: Counter
    checksum_failures: Counter
    io_errors: Counter
    dropped_saves: Counter
    queue_depth: Gauge
    queue_bytes: Gauge
    capacity: Gauge
    used: Gauge


def pool_metrics() -> PoolMetrics:
    reg = CollectorRegistry()
    return PoolMetrics(
        reg,
        Counter("kvpool_lookups_total", "lookups", registry=reg),
        Counter("kvpool_hit_chunks_total", "hits", ["tier"], registry=reg),
        Counter("kvpool_miss_chunks_total", "misses", registry=reg),
        Counter("kvpool_read_bytes_total", "read", ["tier"], registry=reg),
        Counter("kvpool_written_bytes_total", "written", ["tier"], registry=reg),
        Histogram("kvpool_op_seconds", "op", ["op"], buckets=BUCKETS, registry=reg),
        Histogram("kvpool_tier_op_seconds", "tier op", ["tier", "op"], buckets=BUCKETS,
                  registry=reg),
        Counter("kvpool_evictions_total", "evictions", ["tier"], registry=reg),
        Counter("kvpool_checksum_failures_total", "checksum", ["tier"], registry=reg),
        Counter("kvpool_io_errors_total", "io", ["tier"], registry=reg),
        Counter("kvpool_dropped_saves_total", "dropped", ["tier", "cause"], registry=reg),
        Gauge("kvpool_queue_depth", "depth", ["queue"], registry=reg),
        Gauge("kvpool_queue_bytes", "bytes", ["queue"], registry=reg),
        Gauge("kvpool_capacity_bytes", "capacity", ["tier"], registry=reg),
        Gauge("kvpool_used_bytes", "used", ["tier"], registry=reg),
    )


class MetricsEndpoint:
    """Serves ``registry`` at ``http://127.0.0.1:<port>/metrics`` until :meth:`close`;
    ``body`` (if set) is served instead, to play an endpoint that answers garbage."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.body: bytes | None = None
        endpoint = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                body = endpoint.body if endpoint.body is not None \
                    else generate_latest(endpoint.registry)
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> MetricsEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def dead_address() -> str:
    """``127.0.0.1:<port>`` where nothing listens (a port just bound and released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"
