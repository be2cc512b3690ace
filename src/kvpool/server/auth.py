"""Per-tenant tokens of a storage node (DESIGN.md section 6, "Auth")."""

from __future__ import annotations

import hmac
import logging

from kvpool.config import TenantToken
from kvpool.logs import RateLimited

log = logging.getLogger("kvpool.serve")


class Authenticator:
    """Maps tokens to the tenants they may act for. With no tokens configured, auth is off and
    every connection may use every namespace (trusted networks only). The admin token (only
    with auth on) grants no tenant: it may read node-wide STATS and invalidate any namespace
    by id (``kvpool admin``), nothing else."""

    def __init__(self, tokens: list[TenantToken], admin_token: str | None = None) -> None:
        self._tokens = [(t.token.encode(), frozenset(t.tenants)) for t in tokens]
        self._admin = admin_token.encode() if admin_token is not None and tokens else None
        self.tenants: frozenset[str] = frozenset(t for _, ts in self._tokens for t in ts)
        self._say_failed = RateLimited()

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def tenants_for(self, token: bytes) -> frozenset[str] | None:
        """Tenants a token grants, or None for an unknown token. Compared in constant time."""
        found: frozenset[str] | None = None
        for known, tenants in self._tokens:
            if hmac.compare_digest(known, token):
                found = tenants
        return found

    def log_failure(self, node_id: str, peer: str | None) -> None:
        """One WARNING line (event ``auth_failure``, the peer's address, never the token) per
        LOG_INTERVAL_S at most, with the number of failures held back since the last."""
        held = self._say_failed.due()
        if held is not None:
            log.warning("node %s: AUTH with an unknown token from %s; connection closed%s",
                        node_id, peer or "an unnamed peer",
                        f" ({held} more since the last report)" if held else "",
                        extra={"event": "auth_failure", "node": node_id, "peer": peer,
                               "held_back": held})

    def is_admin(self, token: bytes) -> bool:
        """Whether ``token`` is the configured admin token (constant time)."""
        return self._admin is not None and hmac.compare_digest(self._admin, token)
