"""The wire structures of kvpool's KV events: vLLM's (``vllm/distributed/kv_events.py``,
0.32) field for field, in the same order and with the same msgspec options, plus kvpool's
fields after them, so vLLM's own ``msgspec.msgpack.Decoder(type=KVEventBatch)`` parses a
kvpool payload (msgspec ignores map keys and trailing array items a type does not declare).

Batch: an array ``[ts, events, data_parallel_rank, node, incarnation]``. Events: maps tagged
``type`` = the class name. Chunk keys travel as 16-byte ``bytes`` (vLLM's
``ExternalBlockHash`` is ``bytes | int``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import xxhash


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the events (tagged by class name, as vLLM's)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    #: kvpool: the 16-byte namespace id the keys belong to.
    namespace_id: bytes | None = None
    #: kvpool: the tenant whose pool holds them, on a host pool with several tenants
    #: (``server.auth``); None (left out of the map) everywhere else.
    tenant: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    namespace_id: bytes | None = None
    tenant: str | None = None


class AllBlocksCleared(KVCacheEvent):
    #: kvpool: which medium and namespace were dropped (None: everything of the publisher).
    medium: str | None = None
    namespace_id: bytes | None = None
    tenant: str | None = None


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[KVEvent]
    #: kvpool: the node (or host) whose tiers these are, and the publisher's incarnation.
    node: str = ""
    incarnation: str = ""
    #: kvpool: how ``block_hashes`` relate to the chained chunk keys. "": they are the chunk
    #: keys (an embedded pool); "namespace": a storage node's filing of them,
    #: ``xxh3_128(namespace_id || chunk key)`` (``filed_keys``).
    key_scope: str = ""


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def encode(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode(payload: bytes) -> KVEventBatch:
    """Raises msgspec.DecodeError (a ValueError) for a payload that is not a batch."""
    return _DECODER.decode(payload)


#: ``KVEventBatch.key_scope`` of a storage node.
KEY_SCOPE_NAMESPACE = "namespace"


def filed_keys(key_scope: str, namespace_id: bytes, keys: Sequence[bytes]) -> list[bytes]:
    """The keys a publisher of ``key_scope`` announces for a prompt's chained chunk ``keys``
    (a storage node files a client's key under ``xxh3_128(namespace_id || key)``, so that a
    key presented under another tenant's namespace never reaches this one's bytes).
    Raises ValueError for an unknown scope."""
    if key_scope == "":
        return [bytes(k) for k in keys]
    if key_scope == KEY_SCOPE_NAMESPACE:
        digest = xxhash.xxh3_128_digest
        return [digest(namespace_id + k) for k in keys]
    raise ValueError(f"unknown key_scope {key_scope!r}")
