"""Structured logs: the ``log`` config section, text or JSON lines, rate-limited events.

kvpool logs through ``logging`` under ``kvpool.*``. A significant event is one line whose
record carries ``extra={"event": NAME, ...fields}``: text logs show the message (which names
the figures), JSON logs one object per line with ts, level, logger, event, message and the
fields. The events: ``node_joined`` / ``node_left`` and ``node_drained`` /
``node_undrained`` (a client's etcd membership), ``dropped_save`` (a full write-behind
queue, once per burst), ``segment_evicted`` (SSD), ``checksum_failure`` (SSD read: segment,
offset, a key prefix; rate-limited), ``auth_failure`` (a node refused a token: peer),
``memory_reserve`` (a node's start-up memory check); ``kvpool serve``'s own events are listed
in docs/operations.md (Logs). A line logged without an event gets its logger's name under
``kvpool.`` as its event (``ssd``), so no JSON line has a null event.

Only commands configure logging (``configure_logging``): ``kvpool serve`` and ``kvpool demo``.
An embedded pool never touches its host process's logging (vLLM's, an application's).
"""

from __future__ import annotations

import json
import logging
import math
import sys
import threading
import time
from datetime import UTC, datetime
from typing import IO, Any

from kvpool.config import LogConfig

#: Default interval of RateLimited messages.
LOG_INTERVAL_S = 10.0

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: Attributes every LogRecord has; anything else on a record came from ``extra``.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, event, message, then the record's extra
    fields (values JSON cannot hold are written as their str) and ``exc`` for a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": event_name(record),
            "message": record.getMessage(),
        }
        for name, value in vars(record).items():
            if name not in _RECORD_ATTRS and name not in doc:
                doc[name] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def event_name(record: logging.LogRecord) -> str:
    """The record's ``event``; for a line logged without one, its logger's name under
    ``kvpool.`` (``ssd``, ``writebehind``, ``serve``), so that every JSON line names what it is."""
    event = getattr(record, "event", None)
    if event:
        return str(event)
    return record.name.removeprefix("kvpool.") or "log"


#: Marks the handler configure_logging installed, so a second call replaces it.
_OURS = "_kvpool_handler"

#: The logger of a command's status lines (``kvpool serve``'s ``listening`` and ``stopped``):
#: records like any other, but written to stdout at every level setting, since scripts and
#: supervisors read the listening line there: JSON objects with ``log.format: json``, the
#: bare message (``kvpool serve: node ... listening on host:port ...``) with text.
STATUS_LOGGER = "kvpool.status"


def _formatter(cfg: LogConfig) -> logging.Formatter:
    return JsonFormatter() if cfg.format == "json" else logging.Formatter(TEXT_FORMAT)


def configure_logging(cfg: LogConfig, stream: IO[str] | None = None,
                      status_stream: IO[str] | None = None) -> logging.Handler:
    """Send every logger's records at ``cfg.level`` and above to ``stream`` (stderr) as
    ``cfg.format``, and the status logger's (STATUS_LOGGER) to ``status_stream`` (stdout)
    only. Replaces the handlers an earlier call installed (so calling it again applies a
    changed level or format at once); leaves other handlers alone. Returns the handler.
    Never raises for a valid LogConfig."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _OURS, False)]:
        root.removeHandler(old)
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(_formatter(cfg))
    setattr(handler, _OURS, True)
    root.addHandler(handler)
    root.setLevel(cfg.level.upper())
    status = logging.getLogger(STATUS_LOGGER)
    for old in [h for h in status.handlers if getattr(h, _OURS, False)]:
        status.removeHandler(old)
    out = logging.StreamHandler(sys.stdout if status_stream is None else status_stream)
    # text: the bare message, as kvpool serve printed it before these were log records
    out.setFormatter(JsonFormatter() if cfg.format == "json"
                     else logging.Formatter("%(message)s"))
    setattr(out, _OURS, True)
    status.addHandler(out)
    status.setLevel(logging.INFO)
    status.propagate = False
    return handler


def say(cfg: LogConfig, level: int, message: str, event: str, stream: IO[str] | None = None,
        **fields: Any) -> None:
    """Write one record to ``stream`` (stderr) as ``cfg.format`` says, without the logging
    tree: a JSON object, or with text the bare message (``kvpool serve: cannot start: ...``).
    For a command's last words (a start that failed), which must follow the log format
    whether or not logging is configured yet. Never raises for a valid LogConfig."""
    record = logging.LogRecord("kvpool.serve", level, "", 0, message, None, None)
    record.__dict__.update(fields, event=event)
    formatter = JsonFormatter() if cfg.format == "json" else logging.Formatter("%(message)s")
    print(formatter.format(record), file=sys.stderr if stream is None else stream, flush=True)


class RateLimited:
    """At most one message per ``interval_s``; counts the ones held back. Thread-safe."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last = -math.inf
        self._held = 0
        self._lock = threading.Lock()

    def due(self) -> int | None:
        """None: stay quiet (counted). Else: say it now, mentioning the returned number of
        messages held back since the last one."""
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.interval_s:
                self._held += 1
                return None
            held, self._held, self._last = self._held, 0, now
        return held
