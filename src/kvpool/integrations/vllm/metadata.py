"""The opaque objects vLLM carries between the connector's two sides."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from kvpool.integrations.vllm.plan import ReqTransfer


@dataclass
class KVPoolConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's work for every worker rank: chunks to load and chunks to store."""

    loads: list[ReqTransfer] = field(default_factory=list)
    stores: list[ReqTransfer] = field(default_factory=list)
    #: Sessions to end, (session, delete), after this step's saves (kv_transfer_params'
    #: release_session / release_delete).
    releases: list[tuple[str, bool]] = field(default_factory=list)


@dataclass
class KVPoolHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """What a worker rank tells the scheduler at start-up: its namespace (canonical form) and
    where it answers lookups."""

    namespace: dict[str, Any]
    lookup_address: str
