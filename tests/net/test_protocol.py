"""Frame encoding and rendezvous placement (pure functions)."""

from __future__ import annotations

import os
from collections import Counter

import pytest
from tests_support import KEYS

from kvpool.checks import check_keys
from kvpool.keys import Namespace
from kvpool.net.placement import holders, replicas
from kvpool.net.protocol import (
    HEADER_BYTES,
    AuthError,
    Header,
    Op,
    ProtocolError,
    RemoteError,
    Status,
    error_for,
    pack_flags,
    pack_keys,
    parse_flags,
    split_get_keys,
    split_keys,
    unpack_header,
)


def test_header_round_trip_and_size() -> None:
    h = Header(Op.GET, 2**63 + 5, 512, 16 + 512 * 16, 2**40, 0)
    raw = h.pack()
    assert len(raw) == HEADER_BYTES == 32
    assert unpack_header(raw) == h


@pytest.mark.parametrize("raw", [b"XXXX" + bytes(28), b"KVPN\x02" + bytes(27)])
def test_bad_magic_or_version_is_a_protocol_error(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        unpack_header(raw)


def test_keys_round_trip_and_length_check() -> None:
    ns_id = os.urandom(16)
    meta = pack_keys(ns_id, KEYS[:3])
    assert split_keys(meta, 3) == (ns_id, KEYS[:3])
    with pytest.raises(ProtocolError):
        split_keys(meta, 4)
    with pytest.raises(ProtocolError):
        split_keys(meta[:-1], 3)


def test_keys_with_nul_bytes_survive_the_split() -> None:
    """Keys are split by numpy as 16-byte void items: nothing stripped, nothing padded."""
    keys = [bytes(16), b"\x00" * 15 + b"\x01", b"\x01" + bytes(15), *KEYS[:2]]
    assert split_keys(pack_keys(bytes(16), keys), len(keys)) == (bytes(16), keys)
    assert split_keys(pack_keys(bytes(16), []), 0) == (bytes(16), [])


def test_get_metadata_may_carry_touch_keys_after_its_count() -> None:
    ns_id = os.urandom(16)
    meta = pack_keys(ns_id, KEYS[:5])
    assert split_get_keys(meta, 2) == (ns_id, KEYS[:2], KEYS[2:5])
    assert split_get_keys(meta, 5) == (ns_id, KEYS[:5], [])
    for bad, count in ((meta, 6), (meta[:-1], 2), (meta[:10], 0)):
        with pytest.raises(ProtocolError):
            split_get_keys(bad, count)


def test_flags_round_trip_and_reject_anything_but_0_and_1() -> None:
    flags = [True, False, False, True]
    assert parse_flags(pack_flags(flags), 4) == flags
    assert parse_flags(b"", 0) == []
    for bad, count in ((b"\x01\x00", 3), (b"\x01\x02", 2), (b"\xff", 1)):
        with pytest.raises(ProtocolError):
            parse_flags(bad, count)


def test_error_statuses_map_to_exceptions() -> None:
    assert isinstance(error_for(Status.FORBIDDEN, "x"), AuthError)
    assert isinstance(error_for(Status.AUTH_FAILED, "x"), AuthError)
    err = error_for(Status.TOO_LARGE, "big")
    assert isinstance(err, RemoteError) and not isinstance(err, AuthError)
    assert err.status is Status.TOO_LARGE and "big" in str(err)
    assert "unknown status 200" in str(error_for(200, "?"))


def test_namespace_survives_the_wire_and_rejects_junk() -> None:
    from kvtest import byte_namespace
    ns = byte_namespace(salt="acme:2026")
    again = Namespace.from_canonical(ns.canonical())
    assert again == ns and again.id == ns.id and again.tenant == "acme"
    bad = ns.canonical()
    bad["layout"] = dict(bad["layout"], num_layers="4")
    with pytest.raises(ValueError):
        Namespace.from_canonical(bad)
    with pytest.raises(ValueError):
        Namespace.from_canonical({"model": "m"})
    with pytest.raises(ValueError):
        Namespace.from_canonical([1, 2])


NODES = [f"node-{i}" for i in range(5)]


def test_placement_is_deterministic_distinct_and_balanced() -> None:
    keys = [os.urandom(16) for _ in range(5000)]
    placed = replicas(NODES, keys, 2)
    assert placed == replicas(list(reversed(NODES)), keys, 2)  # order of the node list is moot
    assert all(len(p) == 2 and p[0] != p[1] for p in placed)
    primaries = Counter(p[0] for p in placed)
    assert set(primaries) == set(NODES)
    assert min(primaries.values()) > 0.7 * 5000 / len(NODES)


def test_removing_a_node_moves_only_its_keys() -> None:
    keys = [os.urandom(16) for _ in range(3000)]
    before = replicas(NODES, keys, 1)
    after = replicas([n for n in NODES if n != "node-2"], keys, 1)
    for b, a in zip(before, after, strict=True):
        if b[0] != "node-2":
            assert a == b
        else:
            assert a[0] != "node-2"
    # With replicas, the survivor of a removed primary is the old second choice.
    two = replicas(NODES, keys, 2)
    for b, a in zip(two, after, strict=True):
        if b[0] == "node-2":
            assert a[0] == b[1]


def test_placement_edge_cases() -> None:
    assert replicas([], KEYS[:2], 2) == [[], []]
    assert replicas(NODES, [], 2) == []
    assert all(len(p) == 5 for p in replicas(NODES, KEYS[:3], 9))
    with pytest.raises(ValueError):
        replicas(NODES, [b"short"], 1)


def test_small_and_large_batches_place_identically() -> None:
    from kvpool.net import placement
    keys = [os.urandom(16) for _ in range(200)]
    big = replicas(NODES, keys, 3)  # numpy path
    small = [replicas(NODES, [k], 3)[0] for k in keys]  # pure-Python path
    assert len(NODES) * 200 > placement.SMALL_BATCH >= len(NODES)
    assert big == small


def test_holders_are_the_nodes_replicas_names_for_each_key() -> None:
    keys = [os.urandom(16) for _ in range(300)]
    for count in (1, 2, 3):
        expected: dict[str, list[int]] = {}
        for i, nodes in enumerate(replicas(NODES, keys, count)):
            for node in nodes:
                expected.setdefault(node, []).append(i)
        assert holders(NODES, keys, count) == expected
    # R covering every node: each holds every key (None, no per-key list).
    assert holders(NODES, keys, len(NODES)) == dict.fromkeys(sorted(NODES))
    assert holders(NODES[:1], keys, 2) == {NODES[0]: None}
    assert holders([], keys, 2) == {} and holders(NODES, [], 2) == {}


def test_check_keys_refuses_what_is_not_16_bytes() -> None:
    check_keys(KEYS)
    check_keys([])

    class Key(bytes):
        pass

    check_keys([Key(KEYS[0]), KEYS[1]])  # a bytes subclass is a key, as before
    for bad in ([*KEYS[:2], b"short"], [KEYS[0], bytearray(16)], [KEYS[0] + b"x"]):
        with pytest.raises(ValueError, match="16 bytes"):
            check_keys(bad)
