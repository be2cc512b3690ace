"""Client read repair: a chunk that one replica served and another live replica lacked is
written back to the one that lacked it, in the background.

A GET that falls through a replica (it answered "not held") to the next one, which served the
chunk, hands the chunk to :class:`ReadRepairer` (``offer``). The bytes are copied at once (the
caller's output buffer is the caller's again as soon as the read returns), queued under a
byte cap (``cluster.read_repair_bytes``) and sent by one daemon thread as ordinary PUTs, one
per node and namespace. The read never waits for any of it.

Failure contract: nothing here raises to the reader. A full queue drops the repair (counted
``read_repair_dropped``); a PUT that fails or stores nothing counts ``read_repair_failures``
(the node is marked down by the client as for any request). Counters, in the client's
stats: ``read_repair_queued``, ``read_repair_chunks`` / ``read_repair_bytes`` (stored),
``read_repair_dropped``, ``read_repair_failures``; ``read_repair_pending_bytes`` is the
queue's fill.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from kvpool.counters import Counters
from kvpool.keys import Namespace

log = logging.getLogger("kvpool.cluster")

#: send(node_id, ns, keys, datas) -> chunks stored, or None if the node failed.
Send = Callable[[str, Namespace, list[bytes], list[bytes]], "int | None"]

#: Most chunks one background PUT carries.
_BATCH = 64


class ReadRepairer:
    """A bounded queue of chunks to write back, drained by one daemon thread."""

    def __init__(self, send: Send, cap_bytes: int) -> None:
        self._send = send
        self._cap = cap_bytes
        self._queue: deque[tuple[str, Namespace, bytes, bytes]] = deque()
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._closed = False
        self.counters = Counters("read_repair_queued", "read_repair_chunks",
                                 "read_repair_bytes", "read_repair_dropped",
                                 "read_repair_failures")
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self._cap > 0

    def offer(self, node_id: str, ns: Namespace, key: bytes, data: Any) -> bool:
        """Queue ``data`` (a chunk, copied here) for ``node_id``. False when it does not fit
        under the byte cap or the repairer is closed (counted as dropped). Never raises for
        a full queue; ``data`` must support the buffer protocol."""
        nbytes = ns.chunk_bytes
        with self._cond:
            if self._closed or self._queued_bytes + nbytes > self._cap:
                self.counters.add("read_repair_dropped")
                return False
            self._queued_bytes += nbytes
        payload = bytes(data)  # the caller's buffer is reused after the read returns
        with self._cond:
            self._queue.append((node_id, ns, bytes(key), payload))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvpool-read-repair",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()
        self.counters.add("read_repair_queued")
        return True

    def pending_bytes(self) -> int:
        with self._cond:
            return self._queued_bytes

    def _take(self) -> list[tuple[str, Namespace, bytes, bytes]] | None:
        """The next batch: queued chunks for the first entry's node and namespace (up to
        _BATCH). None once closed and empty."""
        with self._cond:
            while not self._queue:
                if self._closed:
                    return None
                self._cond.wait()
            node_id, ns = self._queue[0][0], self._queue[0][1]
            batch: list[tuple[str, Namespace, bytes, bytes]] = []
            rest: deque[tuple[str, Namespace, bytes, bytes]] = deque()
            while self._queue:
                item = self._queue.popleft()
                if len(batch) < _BATCH and item[0] == node_id and item[1].id == ns.id:
                    batch.append(item)
                else:
                    rest.append(item)
            self._queue = rest
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            node_id, ns = batch[0][0], batch[0][1]
            try:
                stored = self._send(node_id, ns, [b[2] for b in batch], [b[3] for b in batch])
            except Exception as exc:  # never let the thread die: a repair is best effort
                log.warning("read repair to node %s failed: %s", node_id, exc)
                stored = None
            nbytes = len(batch) * ns.chunk_bytes
            with self._cond:
                self._queued_bytes -= nbytes
                self._cond.notify_all()
            if stored is None or stored < len(batch):
                self.counters.add("read_repair_failures", len(batch) - (stored or 0))
            if stored:
                self.counters.add_many({"read_repair_chunks": stored,
                                        "read_repair_bytes": stored * ns.chunk_bytes})

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until the queue is empty and nothing is being sent (tests, close)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._queued_bytes == 0, timeout_s)

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop taking repairs; send what is queued for up to ``timeout_s``, then give up
        (the rest is dropped: a repair is best effort)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
