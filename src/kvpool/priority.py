"""Background threads that yield the cores to the engine's own threads."""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger(__name__)


def lower_thread_priority(nice: int) -> None:
    """Raise the calling thread's nice value by ``nice`` (Linux: the nice value is per thread;
    0 or less: unchanged), so the engine's threads get the cores first; such a thread still
    gets its share of a core, so its work completes. Elsewhere, or where the system refuses,
    the thread keeps its priority (logged at debug level): it then competes with the engine
    as an equal, nothing else changes."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as exc:
        log.debug("kvpool: thread %s keeps its priority: %s", threading.current_thread().name,
                  exc)
