"""Rendezvous (highest-random-weight) placement of chunk keys over live nodes.

Every client computes the same replica list for a key from the same set of node ids, with
no coordination: each (node, key) pair gets a pseudo-random score and the R highest-scoring
nodes hold the key. When a node leaves, only the keys it held move (to their next-best node);
when it returns, they move back — and its SSD data is valid again, because keys are content
addresses. Scores are computed for a whole batch of keys at once with numpy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from kvpool.keys import KEY_BYTES

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, vectorised (uint64 arithmetic wraps, as intended)."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    out: np.ndarray = x ^ (x >> np.uint64(31))
    return out


def node_seed(node_id: str) -> int:
    """Fixed 64-bit seed of a node id (the same in every process and on every machine)."""
    return int(xxhash.xxh3_64_intdigest(node_id.encode()))


def scores(node_ids: Sequence[str], keys: Sequence[bytes]) -> np.ndarray:
    """``[len(keys), len(node_ids)]`` uint64 scores. Raises ValueError for a key that is not
    16 bytes."""
    if any(len(k) != KEY_BYTES for k in keys):
        raise ValueError(f"chunk keys must be {KEY_BYTES} bytes")
    raw = np.frombuffer(b"".join(keys), dtype="<u8").reshape(len(keys), 2)
    seeds = np.array([node_seed(n) for n in node_ids], dtype=np.uint64)
    with np.errstate(over="ignore"):
        k = _mix(raw[:, 0] ^ _mix(raw[:, 1]))
        return _mix(k[:, None] ^ seeds[None, :])


_MASK = (1 << 64) - 1


def _mix_int(x: int) -> int:
    """_mix on one Python int: the same function, for small batches where numpy's per-call
    cost dominates."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _score_int(key: bytes, seed: int) -> int:
    lo, hi = int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")
    return _mix_int(_mix_int(lo ^ _mix_int(hi)) ^ seed)


#: Below this many (key, node) pairs, scores are computed in pure Python.
SMALL_BATCH = 48


def holders(node_ids: Sequence[str], keys: Sequence[bytes],
            count: int) -> dict[str, list[int] | None]:
    """For each node holding some of ``keys`` (as ``replicas`` places them), the indices of
    the keys it holds, in order; None where it holds every key (R covers all the nodes: no
    per-key work at all). Keys are not checked (see kvpool.checks.check_keys)."""
    if not node_ids or not keys:
        return {}
    ids = sorted(node_ids)
    if count >= len(ids):
        return dict.fromkeys(ids)
    ranked = np.argsort(scores(ids, keys), axis=1, kind="stable")[:, ::-1][:, :count]
    out: dict[str, list[int] | None] = {}
    for j, node_id in enumerate(ids):
        idx = np.flatnonzero((ranked == j).any(axis=1))
        if idx.size:
            out[node_id] = idx.tolist()
    return out


def replicas(node_ids: Sequence[str], keys: Sequence[bytes], count: int) -> list[list[str]]:
    """For each key, its ``min(count, len(node_ids))`` nodes, highest score first. Empty
    lists when there are no nodes. Raises ValueError for a key that is not 16 bytes."""
    if not node_ids or not keys:
        return [[] for _ in keys]
    ids = sorted(node_ids)
    take = min(count, len(ids))
    if len(ids) == 1:
        if any(len(k) != KEY_BYTES for k in keys):
            raise ValueError(f"chunk keys must be {KEY_BYTES} bytes")
        return [[ids[0]] for _ in keys]
    if len(ids) * len(keys) <= SMALL_BATCH:
        seeds = [node_seed(n) for n in ids]
        out = []
        for key in keys:
            if len(key) != KEY_BYTES:
                raise ValueError(f"chunk keys must be {KEY_BYTES} bytes")
            ranked = sorted(range(len(ids)), key=lambda j: _score_int(key, seeds[j]),
                            reverse=True)
            out.append([ids[j] for j in ranked[:take]])
        return out
    order = np.argsort(scores(ids, keys), axis=1, kind="stable")[:, ::-1][:, :take]
    return [[ids[j] for j in row] for row in order.tolist()]
