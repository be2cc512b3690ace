"""A KV event subscriber that keeps what each publisher holds (docs/routing.md, "Consumer
rules"): SUB on every publisher, a DEALER to each replay socket, per publisher its
incarnation and last sequence number.

- A batch with a new incarnation resets that publisher (``on_reset``), then is applied.
- A sequence gap is filled by replay; when replay cannot fill it (the ring moved on, or the
  batch was never sent: dropped events), the publisher is reset and followed from the new
  sequence number.
- A publisher without ``node`` / ``incarnation`` (vLLM's own) is named by the endpoint it
  was subscribed at; its sequence going back (vLLM restarted: its counter starts at 0 again)
  resets it like a new incarnation.
- A message that is not ``[topic, seq, KVEventBatch]`` is counted (``bad_messages``) and
  dropped; the next good batch then shows as a gap.

A ``listener`` (``EventListener``) sees every batch applied and every reset, with the reason
(``RESET_GAP``, ``RESET_RESTART``): ``kvpool route`` builds its indexes from it.

Not thread-safe: one thread calls ``poll``. ``held`` answers from what was applied.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
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

#: Why a publisher's state was dropped (``EventListener.reset``).
RESET_GAP = "gap"  # batches lost that replay could not fill
RESET_RESTART = "restart"  # a new incarnation, or a sequence that went back


class EventListener(Protocol):
    """Told of every batch a consumer applies (live or replayed, in sequence order) and of
    every reset. ``node``: the publisher's name (its ``node`` field, else the endpoint it
    was subscribed at); ``source``: that endpoint. Called on the polling thread."""

    def batch(self, node: str, source: str, seq: int, batch: KVEventBatch) -> None: ...

    def reset(self, node: str, source: str, reason: str) -> None: ...


@dataclass
class PublisherState:
    incarnation: str = ""
    key_scope: str = ""
    last_seq: int = -1
    #: (medium, namespace id) -> keys held
    held: dict[tuple[str, bytes], set[bytes]] = field(default_factory=dict)
    #: namespace id -> the tenant its events named (a host pool with several tenants)
    tenants: dict[bytes, str] = field(default_factory=dict)
    resets: int = 0
    replayed: int = 0
    source: str = ""  # the endpoint it was subscribed at


class EventConsumer:
    """Follows the publishers at ``endpoints``: (PUB endpoint, replay endpoint or None) each,
    one SUB socket per publisher so a gap is filled from that publisher's replay socket.
    ``on_reset(node)`` is called whenever a node's state is dropped; ``listener`` sees
    batches and resets. ``keep_held`` False keeps no key sets (a listener that indexes for
    itself). Raises zmq.ZMQError for an endpoint that cannot be parsed."""

    def __init__(self, endpoints: Iterable[tuple[str, str | None]],
                 on_reset: Callable[[str], None] | None = None,
                 replay_timeout_s: float = 2.0, listener: EventListener | None = None,
                 keep_held: bool = True) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._poller = zmq.Poller()
        self._subs: dict[zmq.Socket[bytes], zmq.Socket[bytes] | None] = {}
        self._sources: dict[zmq.Socket[bytes], str] = {}
        try:
            for endpoint, replay in endpoints:
                sub = self._socket(zmq.SUB, endpoint)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                self._subs[sub] = self._socket(zmq.DEALER, replay) if replay else None
                self._sources[sub] = endpoint
                self._poller.register(sub, zmq.POLLIN)
        except BaseException:
            self.close()
            raise
        self._replay_timeout_ms = int(replay_timeout_s * 1000)
        self.nodes: dict[str, PublisherState] = {}
        #: subscribed endpoint -> the node name its batches carry
        self.node_at: dict[str, str] = {}
        self._on_reset = on_reset
        self._listener = listener
        self._keep_held = keep_held
        self.bad_messages = 0
        #: batches to ignore as if the network lost them (tests of the gap handling)
        self.skip_seqs: set[int] = set()

    def _socket(self, kind: int, endpoint: str) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        return sock

    def wait(self, timeout_s: float) -> bool:
        """Whether a message is ready within ``timeout_s`` (nothing is received or applied:
        ``poll(0)`` does that)."""
        return bool(self._poller.poll(int(timeout_s * 1000)))

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
                frames = sub.recv_multipart()
                try:
                    if len(frames) != 3 or len(frames[1]) != 8:
                        raise ValueError(f"{len(frames)} frames")
                    seq = int.from_bytes(frames[1], "big")
                    batch = decode(frames[2])
                except (ValueError, msgspec.DecodeError) as exc:
                    self.bad_messages += 1
                    log.warning("kv events from %s: dropped a bad message (%s)",
                                self._sources[sub], exc)
                    continue
                if seq in self.skip_seqs:
                    self.skip_seqs.discard(seq)
                    continue
                applied += self._receive(seq, batch, self._sources[sub], self._subs[sub])

    def _receive(self, seq: int, batch: KVEventBatch, source: str,
                 replay: zmq.Socket[bytes] | None) -> int:
        node = batch.node or source
        self.node_at[source] = node
        state = self.nodes.get(node)
        # A publisher without an incarnation (vLLM) restarts its sequence at 0.
        went_back = state is not None and not batch.incarnation and seq <= state.last_seq
        if state is None or state.incarnation != batch.incarnation or went_back:
            if state is not None:  # a restarted publisher: what it held before is gone
                self._reset(node, state, RESET_RESTART)
            else:
                state = self.nodes[node] = PublisherState(source=source)
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
            applied += self._catch_up(node, state, seq, replay, partial_ok=joining)
        self._apply(node, state, seq, batch)
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
            self._reset(node, state, RESET_GAP)
            return 0
        for rseq, batch in got:
            if batch.incarnation != state.incarnation:
                self._reset(node, state, RESET_RESTART)
                return 0
            self._apply(node, state, rseq, batch)
        state.replayed += len(got)
        return len(got)

    def _reset(self, node: str, state: PublisherState, reason: str) -> None:
        state.held.clear()
        state.tenants.clear()
        state.resets += 1
        if self._on_reset is not None:
            self._on_reset(node)
        if self._listener is not None:
            self._listener.reset(node, state.source, reason)

    def _apply(self, node: str, state: PublisherState, seq: int, batch: KVEventBatch) -> None:
        if self._keep_held:
            self._hold(state, batch)
        state.last_seq = seq
        if self._listener is not None:
            self._listener.batch(node, state.source, seq, batch)

    @staticmethod
    def _hold(state: PublisherState, batch: KVEventBatch) -> None:
        for event in batch.events:
            if event.tenant is not None and event.namespace_id is not None:
                state.tenants[bytes(event.namespace_id)] = event.tenant
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

    def tenant(self, node: str, namespace_id: bytes) -> str | None:
        """The tenant ``node``'s events named for ``namespace_id`` (a host pool with several
        tenants: its namespaces are each one tenant's); None when they named none."""
        state = self.nodes.get(node)
        return state.tenants.get(namespace_id) if state is not None else None

    def filed(self, node: str, namespace_id: bytes, keys: Sequence[bytes]) -> list[bytes]:
        """A prompt's chained chunk ``keys`` as ``node`` announces them."""
        state = self.nodes.get(node)
        return filed_keys(state.key_scope if state else "", namespace_id, keys)

    def leading_run(self, nodes: Sequence[str], namespace_id: bytes,
                    keys: Sequence[bytes]) -> int:
        """How many leading chunks of a prompt (its chained chunk ``keys``) at least one of
        ``nodes`` announced on any medium."""
        have = []
        for node in nodes:
            state = self.nodes.get(node)
            if state is None:
                continue
            held = [ks for (_m, ns), ks in state.held.items() if ns == namespace_id and ks]
            if held:
                have.append((self.filed(node, namespace_id, keys), held))
        n = 0
        while n < len(keys) and any(any(filed[n] in ks for ks in held)
                                    for filed, held in have):
            n += 1
        return n

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
