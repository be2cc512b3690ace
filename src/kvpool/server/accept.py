"""Keeping a node's accept loop alive: the fd limit, accept errors, rate-limited logging.

A failed ``accept`` never ends the loop. Running out of descriptors or kernel memory
(EMFILE, ENFILE, ENOBUFS, ENOMEM) leaves the pending connection in the listen backlog and
the listener readable, so retrying at once would spin: the loop backs off (10 ms doubling to
1 s) until an accept succeeds. Errors that belong to one aborted connection (ECONNABORTED,
EPROTO, ...) are retried at once. Either is counted and logged at most once per
``kvpool.logs.LOG_INTERVAL_S`` with the number of repeats.
"""

from __future__ import annotations

import errno
import logging
import resource
from pathlib import Path

from kvpool.logs import RateLimited

#: Out of descriptors or kernel memory: wait for some to be freed.
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
BACKOFF_MIN_S = 0.01
BACKOFF_MAX_S = 1.0


def raise_fd_limit(log: logging.Logger) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit (a node holds one descriptor per
    connection). Returns the (soft, hard) limits in force afterwards (``log_fd_limits``
    says them). Never raises: if the kernel refuses, the old limit stays and a
    warning says so."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:  # the kernel's ceiling for one process
        try:
            target = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            target = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the fd limit from %d to %d: %s", soft, target, exc,
                        extra={"event": "fd_limit"})
    return soft, hard


#: Descriptors a node needs besides its connections (segment files, etcd, logs, uvloop).
RESERVED_FDS = 64


def log_fd_limits(log: logging.Logger, max_connections: int) -> None:
    """Log the fd limits in force; a warning if they cannot hold ``max_connections``
    connections (the node then backs off on EMFILE instead of serving that many)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    text = f"fd limit: {_limit(soft)} open files (hard limit {_limit(hard)})"
    if soft != resource.RLIM_INFINITY and soft < max_connections + RESERVED_FDS:
        log.warning("%s: too few for server.max_connections=%d; raise the hard limit "
                    "(ulimit -Hn, LimitNOFILE=) or lower server.max_connections", text,
                    max_connections, extra={"event": "fd_limit", "soft": soft, "hard": hard})
    else:
        log.info("%s; server.max_connections=%d", text, max_connections,
                 extra={"event": "fd_limit", "soft": soft, "hard": hard})


def _limit(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else str(value)


class AcceptBackoff:
    """What to do after a failed accept; tracks one burst of failures."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._say = RateLimited()
        self._say_recovered = RateLimited()
        self._delay = 0.0
        self._failures = 0  # in the current burst

    def failed(self, exc: OSError, connections: int) -> float:
        """Count and (rate-limited) log ``exc``; returns how long to wait before the next
        accept (0 for an error of one aborted connection)."""
        self._failures += 1
        resource_error = exc.errno in RESOURCE_ERRNOS
        if resource_error:
            self._delay = min(max(2 * self._delay, BACKOFF_MIN_S), BACKOFF_MAX_S)
        held = self._say.due()
        if held is not None:
            name = errno.errorcode.get(exc.errno or 0, "?")
            repeats = f" ({held} more since the last report)" if held else ""
            if resource_error:
                soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
                self._log.warning(
                    "accept failed: %s %s with %d connections open (fd limit %s, hard %s); "
                    "backing off up to %.0f s and accepting again%s", name, exc.strerror,
                    connections, _limit(soft), _limit(hard), BACKOFF_MAX_S, repeats,
                    extra={"event": "accept_failed", "errno": name, "held_back": held})
            else:
                self._log.info("accept failed: %s %s; accepting again%s", name, exc.strerror,
                               repeats, extra={"event": "accept_failed", "errno": name,
                                               "held_back": held})
        return self._delay if resource_error else 0.0

    def succeeded(self) -> None:
        """An accept worked: the burst (if any) is over."""
        if self._delay and self._say_recovered.due() is not None:
            self._log.info("accepting again after %d failed accepts", self._failures,
                           extra={"event": "accept_recovered", "failures": self._failures})
        self._failures = 0
        self._delay = 0.0
