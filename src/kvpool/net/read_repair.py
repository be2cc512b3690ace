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

Hinted writes use the same queue: a PUT that could not reach one of a chunk's replicas (the
node failed the request, or was marked down and left out of the placement) while another
replica stored it leaves a hint (``offer(..., hint=True)``, counted ``hints_queued``), so a
replica the client was cut from gets the writes it missed once it answers again, including
those it is a later replica of, which no read would ever ask it for. A queued chunk is sent
only while ``ready(node_id)`` says the node is in placement; a send that fails is tried again
later. A chunk not sent within ``max_age_s`` of being queued is dropped (counted
``read_repair_failures``), so a node that is gone for good does not hold the queue.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kvpool.counters import Counters
from kvpool.keys import Namespace

log = logging.getLogger("kvpool.cluster")

#: send(node_id, ns, keys, datas) -> chunks stored, or None if the node failed.
Send = Callable[[str, Namespace, list[bytes], list[bytes]], "int | None"]

#: ready(node_id) -> whether the node is in placement now (not marked down).
Ready = Callable[[str], bool]

#: Most chunks one background PUT carries.
_BATCH = 64
#: How often a queue whose nodes are all unready is looked at again (seconds).
_RECHECK_S = 0.25
#: The pause after a failed send before anything is sent again (seconds).
_RETRY_S = 1.0

#: node id, namespace, key, payload, expiry (time.monotonic()).
_Item = tuple[str, Namespace, bytes, bytes, float]


class ReadRepairer:
    """A bounded queue of chunks to write back, drained by one daemon thread."""

    def __init__(self, send: Send, cap_bytes: int, ready: Ready | None = None,
                 max_age_s: float = 120.0) -> None:
        self._send = send
        self._cap = cap_bytes
        self._ready: Ready = ready if ready is not None else (lambda _node_id: True)
        self._max_age_s = max_age_s
        self._queue: deque[_Item] = deque()
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._closed = False
        self.counters = Counters("read_repair_queued", "read_repair_chunks",
                                 "read_repair_bytes", "read_repair_dropped",
                                 "read_repair_failures", "hints_queued")
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self._cap > 0

    def offer(self, node_id: str, ns: Namespace, key: bytes, data: Any,
              hint: bool = False) -> bool:
        """Queue ``data`` (a chunk, copied here) for ``node_id``; ``hint``: a write the node
        missed rather than a read it lacked (only the counter differs). False when it does
        not fit under the byte cap or the repairer is closed (counted as dropped). Never
        raises for a full queue; ``data`` must support the buffer protocol."""
        nbytes = ns.chunk_bytes
        with self._cond:
            if self._closed or self._queued_bytes + nbytes > self._cap:
                self.counters.add("read_repair_dropped")
                return False
            self._queued_bytes += nbytes
        payload = bytes(data)  # the caller's buffer is reused after the read returns
        with self._cond:
            self._queue.append((node_id, ns, bytes(key), payload,
                                time.monotonic() + self._max_age_s))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvpool-read-repair",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()
        self.counters.add("hints_queued" if hint else "read_repair_queued")
        return True

    def pending_bytes(self) -> int:
        with self._cond:
            return self._queued_bytes

    def _take(self) -> list[_Item] | None:
        """The next batch: queued chunks for the first ready entry's node and namespace (up
        to _BATCH), expired entries dropped on the way. Waits while nothing is ready. None
        once closed and nothing more can be sent."""
        with self._cond:
            while True:
                self._drop_expired_locked()
                if self._closed and not self._queue:
                    return None
                ready: dict[str, bool] = {}
                for item in self._queue:
                    if item[0] not in ready:
                        ready[item[0]] = self._ready(item[0])
                    if ready[item[0]]:
                        return self._batch_locked(item[0], item[1])
                if self._closed:  # what is left cannot be sent now: give it up
                    self._forget_locked(list(self._queue))
                    self._queue.clear()
                    return None
                self._cond.wait(_RECHECK_S if self._queue else None)

    def _batch_locked(self, node_id: str, ns: Namespace) -> list[_Item]:
        batch: list[_Item] = []
        rest: deque[_Item] = deque()
        while self._queue:
            item = self._queue.popleft()
            if len(batch) < _BATCH and item[0] == node_id and item[1].id == ns.id:
                batch.append(item)
            else:
                rest.append(item)
        self._queue = rest
        return batch

    def _drop_expired_locked(self) -> None:
        now = time.monotonic()
        if any(item[4] <= now for item in self._queue):
            expired = [item for item in self._queue if item[4] <= now]
            self._queue = deque(item for item in self._queue if item[4] > now)
            self._forget_locked(expired)

    def _forget_locked(self, items: list[_Item]) -> None:
        """Give up ``items``, already out of the queue (counted as failures): release their
        bytes."""
        if not items:
            return
        self._queued_bytes -= sum(item[1].chunk_bytes for item in items)
        self.counters.add("read_repair_failures", len(items))
        self._cond.notify_all()

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            node_id, ns = batch[0][0], batch[0][1]
            retry = True
            try:
                stored = self._send(node_id, ns, [b[2] for b in batch], [b[3] for b in batch])
            except Exception as exc:  # never let the thread die: a repair is best effort
                log.warning("read repair to node %s failed: %s", node_id, exc,
                            extra={"event": "read_repair_failed", "node": node_id})
                stored, retry = None, False  # a bug, not a node away: not worth a retry
            with self._cond:
                if stored is None and retry and not self._closed:
                    # The node failed (it is marked down now): keep the chunks for when it
                    # answers again; expiry bounds how long.
                    self._queue.extend(batch)
                    self._cond.notify_all()
                    # A node that refused (not marked down, so still "ready") is not asked
                    # again at once: nothing else is sent for a second either.
                    self._cond.wait(_RETRY_S)
                    continue
                self._queued_bytes -= len(batch) * ns.chunk_bytes
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
