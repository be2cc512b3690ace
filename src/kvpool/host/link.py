"""An engine's live attachment to the host pool: the socket and the mapped arena.

A Link is one connection's worth of state: a new one is made at each (re-)attach, so pins
and reservations made on an old connection are recognised as stale by their link (their
ids mean nothing to the new connection, and the host pool released them when the old one
closed). ``call`` raises ``Detached`` for any failure of the socket (host pool dead,
stopped, or silent past ``host.request_timeout_s``); the pool then drops the link.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import select
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvpool.config import HostConfig
from kvpool.errors import ArgumentError, KVPoolError, PinLimitError
from kvpool.host import wire
from kvpool.host.cuda import register_host_memory, unregister_host_memory
from kvpool.tiers.directory import DIRECT_READS_SUPPORTED, DirectoryReader
from kvpool.tiers.prefault import map_address

log = logging.getLogger("kvpool.host")

#: Rounds of ``host.unpin_delay_s`` with nothing released before the unpin flusher sleeps
#: until woken (40 ms at the default: past a burst of reads, not within one).
_QUIET_ROUNDS = 20
#: Reads made through the directory are told to the host pool with the next request, or by
#: the flusher once the oldest has waited this long or this many keys wait: its counts and
#: its eviction's recency lag by at most that, and a burst of reads costs the host pool one
#: frame (told every 2 ms, they cost a 64-chunk read 45 us of its 470, in GIL hand-overs
#: to the flusher and the host pool's work on the other core).
_READS_DELAY_S = 0.05
_READS_MAX_KEYS = 8192
_READS_DROP_KEYS = wire.MAX_READS_KEYS  # one namespace's pending reads fit one frame


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
        #: Keys read through the directory per namespace (hex id), to be counted by the
        #: host pool (a READS frame each, sent as the unpins are), and how many times a
        #: request took what was pending.
        self._reads: dict[str, list[bytes]] = {}
        self._read_keys = 0
        self._reads_since = 0.0  # when the oldest pending read was made (monotonic)
        self._taken = 0
        self._unpins_due = threading.Condition()
        self._flusher_idle = False  # the flusher sleeps until unpin_later wakes it
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.settimeout(host.connect_timeout_s)
            self.sock.connect(host.socket)
            wire.send_frame(self.sock, {"op": wire.HELLO, "version": wire.VERSION,
                                        "token": token, "tenant": host.tenant})
            meta, _, fds = wire.recv_frame(self.sock, 0, want_fds=2)
        except (OSError, ConnectionError) as exc:
            self.sock.close()
            raise Detached(f"cannot attach to the host pool at {host.socket}: {exc}") from None
        directory_bytes = meta.get("directory_bytes", 0)
        if not meta.get("ok") or len(fds) != 1 + bool(directory_bytes):
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
            for fd in fds[1:]:
                socket.close(fd)
            raise Detached(f"cannot map the host pool's arena: {exc}") from None
        finally:
            socket.close(fds[0])
        #: The host pool's read directory, mapped read-only (None: every read asks).
        self.directory: DirectoryReader | None = None
        if directory_bytes:
            try:
                if host.direct_reads and DIRECT_READS_SUPPORTED:
                    self.directory = DirectoryReader(fds[1], int(directory_bytes))
            except (OSError, ValueError) as exc:  # reads ask the host pool, as without one
                log.warning("cannot map the host pool's read directory: %s", exc)
            finally:
                socket.close(fds[1])
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
            if self._unpins or self._reads:
                with self._unpins_due:
                    unpins, reads = self._take_pending()
                if unpins:
                    meta = {**meta, wire.UNPIN_FIELD: unpins}
                if reads:
                    parts = reads + (parts or [])
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

    def alive(self) -> bool:
        """Whether the connection looks up: not closed, and nothing to read on it (a host
        pool that died or closed it makes it readable; a live one sends nothing unasked).
        One ``select``, no wait (a ``select.poll`` object would be shared by the engine's
        threads, and refuses concurrent calls). False also while another thread's answer
        is arriving."""
        if self.closed:
            return False
        try:
            return not select.select((self.sock,), (), (), 0)[0]
        except (OSError, ValueError):
            return False

    def reads_later(self, ns_hex: str, keys: Sequence[bytes]) -> None:
        """Tell the host pool of chunks read through the directory (its counts and its
        eviction's recency), with the next request or by the flusher within
        ``_READS_DELAY_S``."""
        with self._unpins_due:
            if self.closed:
                return
            if self._read_keys + len(keys) > _READS_DROP_KEYS:  # the flusher is stuck on a
                return  # stalled host pool: these go uncounted, not held without bound (nor
            # into a frame past what the host pool counts)
            if not self._reads:
                self._reads_since = time.monotonic()
            pending = self._reads.get(ns_hex)
            if pending is None:
                self._reads[ns_hex] = list(keys)
            else:
                pending.extend(keys)
            self._read_keys += len(keys)
            if self._flusher_idle or self._read_keys >= _READS_MAX_KEYS:
                self._flusher_idle = False
                self._unpins_due.notify()

    def _take_pending(self) -> tuple[list[int], list[tuple[dict[str, Any], wire.Bytes]]]:
        """The released pins not yet told, and the READS frames of the reads not yet told
        (under ``_unpins_due``)."""
        unpins, reads = self._unpins, self._reads
        self._unpins, self._reads = [], {}
        self._read_keys = 0
        self._taken += 1
        return unpins, [({"op": wire.READS, "ns": ns, "n": len(keys)}, wire.pack_keys(keys))
                        for ns, keys in reads.items()]

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
        ``host.unpin_delay_s`` (a request takes them, so what is still there after the wait
        waited that long), with the pending reads, which it also sends on their own once
        due (``_READS_DELAY_S``); ends when the link closes."""
        delay = self._host.unpin_delay_s
        quiet = 0  # rounds in a row that found nothing released
        while True:
            with self._unpins_due:
                if self.closed:
                    return
                reads_in = _READS_DELAY_S - (time.monotonic() - self._reads_since) \
                    if self._read_keys < _READS_MAX_KEYS else 0.0
                if not self._unpins and not (self._reads and reads_in <= 0):
                    if self._reads:  # not due yet
                        self._unpins_due.wait(max(reads_in, delay))
                    elif quiet >= _QUIET_ROUNDS:  # reads stopped: sleep until one releases
                        self._flusher_idle = True
                        self._unpins_due.wait()
                        quiet = 0
                    else:
                        self._unpins_due.wait(delay)
                        quiet += 1
                    continue
                quiet = 0
                if self._unpins:
                    taken = self._taken
                    self._unpins_due.wait(delay)  # a request may carry them meanwhile
                    if self.closed:
                        return
                    if self._taken != taken:
                        continue  # a request carried them
                unpins, reads = self._take_pending()
            if unpins:
                reads.append(({"op": wire.UNPIN, "ids": unpins}, b""))
            self._send_frames(reads)

    def send(self, meta: dict[str, Any], tail: wire.Bytes = b"") -> None:
        """A frame with no answer (unpin, abort, put); a failure detaches quietly."""
        self._send_frames([(meta, tail)])

    def _send_frames(self, frames: list[tuple[dict[str, Any], wire.Bytes]]) -> None:
        with self._lock:
            if self.closed or not frames:
                return
            try:
                wire.send_frames(self.sock, frames)
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
        if self.directory is not None:
            self.directory.close()
        self.arena.release()  # slices of it still held keep the mapping alive
        with contextlib.suppress(BufferError):
            self.mapping.close()  # views still held keep it mapped until released

    def close(self) -> None:
        with self._lock:
            self._close_locked()
