"""Argument checks of the pool's public API: misuse raises a clear error before any tier is
touched (ArgumentError for wrong types, ChunkSizeError for wrong buffer sizes)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvpool.errors import ArgumentError, ChunkSizeError, PoolClosedError, UnknownNamespaceError
from kvpool.keys import KEY_BYTES, Namespace


def check_namespace_type(ns: object) -> None:
    if not isinstance(ns, Namespace):
        raise ArgumentError(f"ns must be a kvpool Namespace (register_namespace(Namespace("
                            f"...))), got {type(ns).__name__}")


def check_key(key: bytes, what: str = "key") -> None:
    """Raises ArgumentError unless ``key`` is ``bytes`` of KEY_BYTES; the message names what
    is wrong: the length, or the type (a bytearray or memoryview is refused even at the
    right length: keys are dict keys and must be immutable; pass ``bytes(key)``)."""
    if isinstance(key, bytes):
        if len(key) != KEY_BYTES:
            raise ArgumentError(f"{what} must be a chunk key of {KEY_BYTES} bytes, got "
                                f"{len(key)} bytes")
        return
    if isinstance(key, bytearray | memoryview):
        raise ArgumentError(f"{what} must be a chunk key of type bytes, got a "
                            f"{type(key).__name__} of {memoryview(key).nbytes} bytes (pass "
                            "bytes(key): keys must be immutable)")
    raise ArgumentError(f"{what} must be a chunk key of {KEY_BYTES} bytes, got "
                        f"{type(key).__name__}")


def check_keys(keys: Sequence[bytes]) -> None:
    """Raises ArgumentError unless ``keys`` is a sequence of ``bytes`` keys of KEY_BYTES
    each, naming the first bad one. Every call of the pool's API checks its keys: a batch of
    good keys is checked in C (two passes of map), anything else key by key."""
    if type(keys) is not list and (  # a list needs no ABC check (microseconds a call)
            isinstance(keys, bytes | bytearray | memoryview | str)
            or not isinstance(keys, Sequence)):
        raise ArgumentError(f"keys must be a sequence of {KEY_BYTES}-byte chunk keys "
                            f"(e.g. ns.chunk_keys(tokens)), got {type(keys).__name__}")
    if set(map(type, keys)) <= _BYTES_ONLY and set(map(len, keys)) <= _KEY_LENGTH:
        return
    for i, key in enumerate(keys):
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            check_key(key, f"keys[{i}]")


_BYTES_ONLY, _KEY_LENGTH = frozenset({bytes}), frozenset({KEY_BYTES})


def check_same_length(keys: Sequence[bytes], others: Sequence[object], what: str) -> None:
    if len(keys) != len(others):
        raise ArgumentError(f"keys ({len(keys)}) and {what} ({len(others)}) differ in length")


def check_size(ns: Namespace, view: memoryview, what: str) -> None:
    if view.nbytes != ns.chunk_bytes:
        raise ChunkSizeError(f"{what} has {view.nbytes} bytes; namespace {ns.model!r} "
                             f"chunks have {ns.chunk_bytes}")


#: ``check_registered`` without keys to check.
NO_KEYS = object()


def check_registered(closed: bool, namespaces: Mapping[bytes, Namespace], ns: Namespace,
                     keys: Sequence[bytes] | object = NO_KEYS) -> Namespace:
    """``ns`` after checking that the pool is open (``closed``) and ``ns`` is one of its
    ``namespaces``, and ``keys`` (when passed: None is checked, and refused, like any other
    non-sequence) with check_keys. Raises PoolClosedError, ArgumentError,
    UnknownNamespaceError. Shared by the embedded and the attached pool."""
    if closed:
        raise PoolClosedError("KVPool is closed")
    check_namespace_type(ns)
    if ns.id not in namespaces:
        raise UnknownNamespaceError(f"namespace {ns.id.hex()} ({ns.model!r}) is not "
                                    "registered; call register_namespace first")
    if keys is not NO_KEYS:
        check_keys(keys)  # type: ignore[arg-type]
    return ns
