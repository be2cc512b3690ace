"""A KV event subscriber that keeps what each publisher holds (docs/routing.md, "Consumer
rules"): SUB on every publisher, a DEALER to each replay socket, per publisher its
incarnation and last sequence number.

- A batch with a new incarnation resets that publisher (``on_reset``), then is applied.
- A sequence gap is filled by replay; when replay cannot fill it (the ring moved on, or the
  batch was never sent: dropped events), the publisher is reset and followed from the new
  sequence number.

Not thread-safe: one thread calls ``poll``. ``held`` answers from what was applied.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import zmq

from kvpool.events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode,
    filed_keys,
)

log = logging.getLogger(__name__)


@dataclass
class PublisherState:
    incarnation: str = ""
    key_scope: str = ""
    last_seq: int = -1
    #: (medium, namespace id) -> keys held
    held: dict[tuple[str, bytes], set[bytes]] = field(default_factory=dict)
    resets: int = 0
    replayed: int = 0


class EventConsumer:
    """Follows the publishers at ``endpoints``: (PUB endpoint, replay endpoint or None) each,
    one SUB socket per publisher so a gap is filled from that publisher's replay socket.
    ``on_reset(node)`` is called whenever a node's state is dropped. Raises zmq.ZMQError for
    an endpoint that cannot be parsed."""

    def __init__(self, endpoints: list[tuple[str, str | None]],
                 on_reset: Callable[[str], None] | None = None,
                 replay_timeout_s: float = 2.0) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._poller = zmq.Poller()
        self._subs: dict[zmq.Socket[bytes], zmq.Socket[bytes] | None] = {}
        try:
            for endpoint, replay in endpoints:
                sub = self._socket(zmq.SUB, endpoint)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                self._subs[sub] = self._socket(zmq.DEALER, replay) if replay else None
                self._poller.register(sub, zmq.POLLIN)
        except BaseException:
            self.close()
            raise
        self._replay_timeout_ms = int(replay_timeout_s * 1000)
        self.nodes: dict[str, PublisherState] = {}
        self._on_reset = on_reset
        #: batches to ignore as if the network lost them (tests of the gap handling)
        self.skip_seqs: set[int] = set()

    def _socket(self, kind: int, endpoint: str) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        return sock

    def poll(self, timeout_s: float) -> int:
        """Apply what arrives within ``timeout_s``; returns the batches applied (replayed
        ones included)."""
        applied = 0
        timeout = int(timeout_s * 1000)
        while True:
            ready = dict(self._poller.poll(timeout))
            if not ready:
                return applied
            timeout = 0
            for sub in ready:
                _topic, seq_bytes, payload = sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                if seq in self.skip_seqs:
                    self.skip_seqs.discard(seq)
                    continue
                applied += self._receive(seq, decode(payload), self._subs[sub])

    def _receive(self, seq: int, batch: KVEventBatch,
                 replay: zmq.Socket[bytes] | None) -> int:
        state = self.nodes.get(batch.node)
        if state is None or state.incarnation != batch.incarnation:
            if state is not None:  # a restarted publisher: what it held before is gone
                self._reset(batch.node, state)
            else:
                state = self.nodes[batch.node] = PublisherState()
            state.incarnation = batch.incarnation
            state.key_scope = batch.key_scope
            state.last_seq = -1  # history from the start, as far as the ring still holds it
            joining = True
        else:
            joining = False
        if seq <= state.last_seq:
            return 0  # already applied
        applied = 0
        if seq > state.last_seq + 1:
            applied += self._catch_up(batch.node, state, seq, replay, partial_ok=joining)
        self._apply(state, batch)
        state.last_seq = seq
        return applied + 1

    def _catch_up(self, node: str, state: PublisherState, seq: int,
                  sock: zmq.Socket[bytes] | None, partial_ok: bool = False) -> int:
        """Ask the node's replay socket for the missing batches; reset the node when they
        cannot all be had. ``partial_ok``: a publisher seen for the first time, whose older
        batches may have left the ring: what replay still has is applied (a missing older
        batch can only hide chunks, never show one that is gone)."""
        want = state.last_seq + 1
        got: list[tuple[int, KVEventBatch]] = []
        if sock is not None:
            sock.send_multipart((b"", want.to_bytes(8, "big")))
            while sock.poll(self._replay_timeout_ms):
                frames = sock.recv_multipart()
                if len(frames) != 4 or frames[3] == b"":
                    break
                rseq = int.from_bytes(frames[2], "big")
                if want <= rseq < seq:
                    got.append((rseq, decode(frames[3])))
        got.sort(key=lambda item: item[0])
        if partial_ok and got:
            want = got[0][0]
        if [s for s, _ in got] != list(range(want, seq)) and not (partial_ok and not got):
            log.info("kv events: node %s lost batches %d..%d; resetting it", node, want,
                     seq - 1)
            self._reset(node, state)
            return 0
        for rseq, batch in got:
            if batch.incarnation != state.incarnation:
                self._reset(node, state)
                return 0
            self._apply(state, batch)
            state.last_seq = rseq
        state.replayed += len(got)
        return len(got)

    def _reset(self, node: str, state: PublisherState) -> None:
        state.held.clear()
        state.resets += 1
        if self._on_reset is not None:
            self._on_reset(node)

    @staticmethod
    def _apply(state: PublisherState, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                keys = state.held.setdefault((event.medium or "", event.namespace_id or b""),
                                             set())
                keys.update(bytes(k) for k in event.block_hashes if isinstance(k, bytes))
            elif isinstance(event, BlockRemoved):
                keys = state.held.get((event.medium or "", event.namespace_id or b""), set())
                keys.difference_update(k for k in event.block_hashes if isinstance(k, bytes))
            elif isinstance(event, AllBlocksCleared):
                for (medium, ns_id), keys in state.held.items():
                    if (event.medium in (None, medium)
                            and event.namespace_id in (None, ns_id)):
                        keys.clear()

    def held(self, node: str, medium: str, namespace_id: bytes) -> set[bytes]:
        """The keys ``node`` announced it holds on ``medium``, as it announced them (a
        storage node's are filed keys: ``filed``)."""
        state = self.nodes.get(node)
        if state is None:
            return set()
        return set(state.held.get((medium, namespace_id), set()))

    def filed(self, node: str, namespace_id: bytes, keys: Sequence[bytes]) -> list[bytes]:
        """A prompt's chained chunk ``keys`` as ``node`` announces them."""
        state = self.nodes.get(node)
        return filed_keys(state.key_scope if state else "", namespace_id, keys)

    def prefix(self, node: str, medium: str, namespace_id: bytes,
               keys: Sequence[bytes]) -> int:
        """How many leading chunks of a prompt (its chained chunk ``keys``) ``node`` holds on
        ``medium``, as far as its events told."""
        state = self.nodes.get(node)
        have = state.held.get((medium, namespace_id)) if state is not None else None
        if not have:
            return 0
        n = 0
        for key in self.filed(node, namespace_id, keys):
            if key not in have:
                break
            n += 1
        return n

    def close(self) -> None:
        for sub, replay in self._subs.items():
            sub.close(0)
            if replay is not None:
                replay.close(0)
