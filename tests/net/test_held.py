"""The node's ledger of held bytes (server/held.py): limits node-wide, per tenant and for a
tenant's PUTs; a take never waits and takes what fits."""

from __future__ import annotations

from kvpool.server.held import MIN_DERIVED_BYTES, HeldBytes, derived_limit

MiB = 1 << 20


def test_a_take_gets_what_fits_under_every_limit_and_a_give_frees_it() -> None:
    held = HeldBytes(limit=100 * MiB, tenant_limit=50 * MiB, put_limit=20 * MiB)
    assert held.take("acme", 8, 4 * MiB, put=True) == 5  # 20 MiB of PUTs for acme
    assert held.take("acme", 1, 4 * MiB, put=True) == 0
    assert held.take("acme", 1, 30 * MiB) == 1  # a GET: 50 MiB for acme in all
    assert held.take("acme", 1, MiB) == 0
    assert held.take("beta", 1, 50 * MiB) == 1  # the node's 100 MiB
    assert held.take("gamma", 1, MiB) == 0
    assert "100 of" not in held.describe("gamma") and "server.max_held_bytes" in \
        held.describe("gamma")
    held.give("acme", 20 * MiB, put=True)
    held.give("acme", 30 * MiB)
    held.give("beta", 50 * MiB)
    assert held.held == 0
    assert held.take("gamma", 1, 50 * MiB) == 1 and held.take("acme", 0, MiB) == 0


def test_the_derived_limit_is_a_quarter_of_dram_at_least_256_mib() -> None:
    assert derived_limit(0, 64 * MiB) == MIN_DERIVED_BYTES == 256 * MiB
    assert derived_limit(0, 64 << 30) == 16 << 30
    assert derived_limit(5 * MiB, 64 << 30) == 5 * MiB
