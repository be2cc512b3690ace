"""An engine's live attachment to the host pool: the socket and the mapped arena.

A Link is one connection's worth of state: a new one is made at each (re-)attach, so pins
and reservations made on an old connection are recognised as stale by their link (their
ids mean nothing to the new connection, and the host pool released them when the old one
closed). ``call`` raises ``Detached`` for any failure of the socket (host pool dead,
stopped, or silent past ``host.request_timeout_s``); the pool then drops the link.
"""

from __future__ import annotations

import contextlib
import mmap
import socket
import threading
from typing import Any

from kvpool.config import HostConfig
from kvpool.errors import ArgumentError, KVPoolError, PinLimitError
from kvpool.host import wire
from kvpool.host.cuda import register_host_memory, unregister_host_memory
from kvpool.tiers.prefault import map_address

#: Rounds of ``host.unpin_delay_s`` with nothing released before the unpin flusher sleeps
#: until woken (40 ms at the default: past a burst of reads, not within one).
_QUIET_ROUNDS = 20


class Detached(KVPoolError):
    """The host pool is not reachable now: the caller answers a miss or a dropped save."""


class AttachError(KVPoolError):
    """The host pool refused the attach (uid, token, tenant): a setting to fix."""


class Link:
    def __init__(self, host: HostConfig, token: str | None) -> None:
        assert host.socket is not None
        self._host = host
        self._lock = threading.Lock()  # the socket: one request and its answer at a time
        self.closed = False
        #: Released pins not yet told to the host pool, under a lock of their own: the
        #: flusher never waits for the socket lock a request holds through its round trip
        #: (waiting there, it was handed the GIL at every answer: 116 us a read).
        self._unpins: list[int] = []
        self._unpins_due = threading.Condition()
        self._flusher_idle = False  # the flusher sleeps until unpin_later wakes it
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.settimeout(host.connect_timeout_s)
            self.sock.connect(host.socket)
            wire.send_frame(self.sock, {"op": wire.HELLO, "version": wire.VERSION,
                                        "token": token, "tenant": host.tenant})
            meta, _, fds = wire.recv_frame(self.sock, 0, want_fds=1)
        except (OSError, ConnectionError) as exc:
            self.sock.close()
            raise Detached(f"cannot attach to the host pool at {host.socket}: {exc}") from None
        if not meta.get("ok") or len(fds) != 1:
            for fd in fds:
                with contextlib.suppress(OSError):
                    socket.close(fd)
            self.sock.close()
            error = str(meta.get("error", "no arena sent"))
            if error.startswith("busy:"):  # host.max_connections: try again later
                raise Detached(f"the host pool at {host.socket} is busy: {error}")
            raise AttachError(f"host pool at {host.socket} refused the attach: {error}")
        self.tenant = str(meta["tenant"])
        self.durable = bool(meta.get("durable"))
        self.arena_bytes = int(meta["arena_bytes"])
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if host.populate else 0)
        try:
            self.mapping = mmap.mmap(fds[0], self.arena_bytes, flags=flags,
                                     prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            self.sock.close()
            raise Detached(f"cannot map the host pool's arena: {exc}") from None
        finally:
            socket.close(fds[0])
        wire.set_kernel_timeouts(self.sock, host.request_timeout_s)
        self._reader = wire.FrameReader(self.sock)
        threading.Thread(target=self._flush_unpins, name="kvpool-host-unpin",
                         daemon=True).start()
        #: The whole arena: slots are slices of it (no memoryview of the mapping per slot).
        self.arena = memoryview(self.mapping)
        self.address = map_address(self.mapping)
        self.cuda = host.cuda_register == "auto" and \
            register_host_memory(self.address, self.arena_bytes)

    def view(self, offset: int, nbytes: int) -> memoryview:
        """The arena bytes of a slot; ValueError for a range outside the arena (a
        host pool never sends one)."""
        if offset < 0 or offset + nbytes > self.arena_bytes:
            raise ValueError(f"slot [{offset}, {offset + nbytes}) outside the arena")
        return self.arena[offset:offset + nbytes]

    def call(self, meta: dict[str, Any], tail: wire.Bytes = b"",
             parts: list[tuple[dict[str, Any], wire.Bytes]] | None = None
             ) -> tuple[dict[str, Any], bytearray]:
        """Send ``parts`` (frames with no answer), then the request carrying the pending
        unpins, in one write where they are small; its answer. Detached on a socket failure
        (the link is closed)."""
        with self._lock:
            if self.closed:
                raise Detached("the host pool connection is closed")
            if self._unpins:
                with self._unpins_due:
                    meta = {**meta, wire.UNPIN_FIELD: self._unpins}
                    self._unpins = []
            try:
                if parts:
                    wire.send_frames(self.sock, [*parts, (meta, tail)])
                else:
                    wire.send_frame(self.sock, meta, tail)
                answer, payload = self._reader.read(self._host.max_frame_bytes)
            except (OSError, ConnectionError) as exc:
                self._close_locked()
                raise Detached(f"host pool connection lost: {exc}") from None
        if not answer.get("ok"):
            if answer.get("kind") == PinLimitError.__name__:
                raise PinLimitError(str(answer.get("error")))
            raise ArgumentError(f"host pool refused {meta.get('op')}: {answer.get('error')}")
        return answer, payload

    def unpin_later(self, ids: list[int]) -> None:
        """Release pins: told to the host pool with the next request, or by this link's
        flusher thread within ``2 * host.unpin_delay_s`` if none comes (one wake-up of the
        host pool per read instead of two). The flusher is woken only when it has gone to
        sleep after ``_QUIET_ROUNDS`` rounds with nothing released; while reads come it
        looks every ``host.unpin_delay_s`` on its own (a wake-up per read cost the reading
        thread the GIL: 36 us a read). Pins of a closed link were released by the host pool
        already."""
        with self._unpins_due:
            if self.closed:
                return
            self._unpins.extend(ids)
            if self._flusher_idle:
                self._flusher_idle = False
                self._unpins_due.notify()

    def _flush_unpins(self) -> None:
        """The flusher thread: sends the pending pins that no request carried for a whole
        ``host.unpin_delay_s`` (a request takes the list and leaves a new one, so a list
        still there after the wait waited that long); ends when the link closes."""
        delay = self._host.unpin_delay_s
        quiet = 0  # rounds in a row that found nothing released
        while True:
            with self._unpins_due:
                if self.closed:
                    return
                pending = self._unpins
                if not pending:
                    if quiet >= _QUIET_ROUNDS:  # reads stopped: sleep until one releases
                        self._flusher_idle = True
                        self._unpins_due.wait()
                        quiet = 0
                    else:
                        self._unpins_due.wait(delay)
                        quiet += 1
                    continue
                quiet = 0
                self._unpins_due.wait(delay)  # a request may carry them meanwhile
                if self.closed:
                    return
                if self._unpins is not pending:
                    continue  # a request carried them
                self._unpins = []
            self.send({"op": wire.UNPIN, "ids": pending})

    def send(self, meta: dict[str, Any], tail: wire.Bytes = b"") -> None:
        """A frame with no answer (unpin, abort, put); a failure detaches quietly."""
        with self._lock:
            if self.closed:
                return
            try:
                wire.send_frame(self.sock, meta, tail)
            except OSError:
                self._close_locked()

    def _close_locked(self) -> None:
        if self.closed:
            return
        self.closed = True
        with self._unpins_due:
            self._unpins_due.notify_all()
        with contextlib.suppress(OSError):
            self.sock.close()
        if self.cuda:
            unregister_host_memory(self.address)
        self.arena.release()  # slices of it still held keep the mapping alive
        with contextlib.suppress(BufferError):
            self.mapping.close()  # views still held keep it mapped until released

    def close(self) -> None:
        with self._lock:
            self._close_locked()
