"""Per-tenant tokens of a storage node (DESIGN.md section 6, "Auth")."""

from __future__ import annotations

import hmac

from kvpool.config import TenantToken


class Authenticator:
    """Maps tokens to the tenants they may act for. With no tokens configured, auth is off and
    every connection may use every namespace (trusted networks only)."""

    def __init__(self, tokens: list[TenantToken]) -> None:
        self._tokens = [(t.token.encode(), frozenset(t.tenants)) for t in tokens]

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
