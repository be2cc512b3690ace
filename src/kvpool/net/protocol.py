"""kvpool's binary frame format, shared by ``kvpool serve`` and the client.

Every frame is a fixed 32-byte header, then ``meta_len`` bytes of metadata, then
``payload_len`` bytes of payload::

    magic   4s  b"KVPN"
    version u8  PROTOCOL_VERSION
    status  u8  0 in requests; a Status in responses
    opcode  u16 an Op; responses set RESPONSE_BIT
    req_id  u64 echoed in the response
    count   u32 items in the request (keys); a result count in responses
    meta    u32 metadata length
    payload u64 payload length

Metadata by opcode (``ns`` = 16-byte namespace id, ``keys`` = count x 16 bytes):

=============  =========================  ==========================================
op             request                    OK response
=============  =========================  ==========================================
AUTH           token (UTF-8)              JSON {"node_id", "tenants"}
PING           -                          -
NAMESPACE      canonical namespace JSON   ns (the id the node computed); count = the
                                          node's Feature bits (0 from nodes older
                                          than EXISTS and TOUCH)
EXISTS_PREFIX  ns + keys                  count = leading keys present (kept for old
                                          clients; a node answers for its own copies)
EXISTS         ns + keys                  count flag bytes in key order (1 = this node
                                          holds the key); count = keys held
TOUCH          ns + keys                  count = keys found; each is marked as just
                                          read in the node's eviction policies
GET            ns + keys [+ touch keys]   count flag bytes (1 = found); payload = the
                                          found chunks in key order, chunk_bytes each
PUT            ns + keys; payload =       count = chunks stored
               count x chunk_bytes
DELETE         ns + keys                  count = chunks removed
INVALIDATE     ns (declared, or any id    count = chunks dropped
               for the admin token / auth
               off, or a tenant's known
               to the node)
STATS          -                          JSON counters and the node's namespaces:
                                          node-wide for the admin token (or with auth
                                          off), the asking tenant's own otherwise
RETAIN         ns + keys + JSON retention count = keys recorded (docs/retention.md);
               (retention/spec.py          PIN_LIMIT when the pins would pass the
               ``to_mapping``)             node's pool.max_pinned_fraction
RELEASE        ns + JSON {"session",      count = chunks released (the session is
               "delete"}                  scoped by the namespace's tenant)
=============  =========================  ==========================================

GET's ``count`` is the number of keys to fetch; a client may append further keys after them
(only to nodes with Feature.GET_TOUCH), which the node touches, as TOUCH would, without
fetching or answering for them: a read's other-replica touches ride in the GETs it sends
anyway.

An error response has a non-zero status and a UTF-8 message as metadata. Bytes that do not
parse as a frame raise ProtocolError; the node then closes that one connection.

Versions: EXISTS, TOUCH and GET's touch keys were added without a version bump, because a
node that does not know an opcode (or finds extra keys in a GET) closes the connection, which
a client cannot tell from a crash. Instead a node advertises them as Feature bits in its
NAMESPACE answer, which every connection sends before its first keyed request, and a client
uses them only on nodes that advertised them. To an older node it sends EXISTS_PREFIX and
reads the answer as "the first ``count`` keys held, the rest unknown" (so an old node can
only under-report: a miss, never a wrong hit), and sends no touches. RETAIN and RELEASE are
sent only to nodes advertising Feature.RETENTION (an older node keeps plain LRU-by-policy
behaviour: no pins, TTLs or sessions); an old client never sends them.
"""

from __future__ import annotations

import enum
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.errors import KVPoolError, PinLimitError
from kvpool.keys import KEY_BYTES, split_key_bytes

MAGIC = b"KVPN"
PROTOCOL_VERSION = 1
HEADER = struct.Struct("<4sBBHQIIQ")
HEADER_BYTES = HEADER.size
RESPONSE_BIT = 0x8000
NS_BYTES = KEY_BYTES


class Op(enum.IntEnum):
    AUTH = 1
    PING = 2
    NAMESPACE = 3
    EXISTS_PREFIX = 4
    GET = 5
    PUT = 6
    DELETE = 7
    INVALIDATE = 8
    STATS = 9
    EXISTS = 10
    TOUCH = 11
    RETAIN = 12
    RELEASE = 13


class Feature(enum.IntFlag):
    """Bits a node sets in the count of its NAMESPACE answer."""

    EXISTS_TOUCH = 1  # knows Op.EXISTS and Op.TOUCH
    GET_TOUCH = 2  # touches the keys a GET carries after its ``count`` keys
    RETENTION = 4  # knows Op.RETAIN and Op.RELEASE


#: Everything this version speaks: a node advertises it, a client masks answers with it.
FEATURES = Feature.EXISTS_TOUCH | Feature.GET_TOUCH | Feature.RETENTION
#: Opcodes whose metadata is a namespace id and keys (sized by server.max_keys).
KEYED_OPS = frozenset({Op.EXISTS_PREFIX, Op.EXISTS, Op.TOUCH, Op.GET, Op.PUT, Op.DELETE,
                       Op.INVALIDATE, Op.RETAIN})
#: Most keys a client sends in one RETAIN (its JSON must fit the room max_keys leaves).
RETAIN_BATCH_KEYS = 4096


class Status(enum.IntEnum):
    OK = 0
    BAD_REQUEST = 1
    AUTH_REQUIRED = 2
    AUTH_FAILED = 3
    FORBIDDEN = 4
    UNKNOWN_NAMESPACE = 5
    TOO_LARGE = 6
    BUSY = 7
    INTERNAL = 8
    PIN_LIMIT = 9  # RETAIN: the pins would pass the node's pool.max_pinned_fraction


class ProtocolError(KVPoolError):
    """Bytes on a connection that are not a valid frame; the connection cannot continue."""


class RemoteError(KVPoolError):
    """A node answered a request with an error status (bad request, auth, limits)."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(f"{status.name}: {message}")
        self.status = status
        self.message = message


class AuthError(RemoteError):
    """The node refused the token, or the namespace belongs to another tenant."""


class RemotePinLimitError(RemoteError, PinLimitError):
    """A node refused a RETAIN's pins (status PIN_LIMIT): its pinned bytes would pass its
    pool.max_pinned_fraction."""


@dataclass(slots=True)
class Header:
    """One frame's header. Not frozen: built twice per request on each side, and a frozen
    dataclass's ``__init__`` costs five times as much (treat it as immutable)."""

    op: int
    req_id: int
    count: int
    meta_len: int
    payload_len: int
    status: int = 0

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, PROTOCOL_VERSION, self.status, self.op, self.req_id,
                           self.count, self.meta_len, self.payload_len)

    @property
    def is_response(self) -> bool:
        return bool(self.op & RESPONSE_BIT)


def unpack_header(raw: bytes | bytearray | memoryview) -> Header:
    """Parse 32 header bytes. Raises ProtocolError on a bad magic or version."""
    magic, version, status, op, req_id, count, meta_len, payload_len = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {bytes(magic)!r}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {version} "
                            f"(this side speaks {PROTOCOL_VERSION})")
    return Header(op, req_id, count, meta_len, payload_len, status)


def pack_keys(ns_id: bytes, keys: list[bytes] | tuple[bytes, ...]) -> bytes:
    """Metadata of a keyed request: namespace id followed by the keys."""
    return ns_id + b"".join(keys)


def split_keys(meta: bytes | memoryview, count: int) -> tuple[bytes, list[bytes]]:
    """Inverse of pack_keys. Raises ProtocolError if the length does not match ``count``."""
    if len(meta) != NS_BYTES + count * KEY_BYTES:
        raise ProtocolError(f"metadata of {len(meta)} bytes does not hold a namespace id and "
                            f"{count} keys")
    raw = bytes(meta)
    return raw[:NS_BYTES], split_key_bytes(raw, NS_BYTES)


def split_get_keys(meta: bytes | memoryview,
                   count: int) -> tuple[bytes, list[bytes], list[bytes]]:
    """A GET's metadata: namespace id, the ``count`` keys to fetch, the keys to touch after
    them. Raises ProtocolError unless it holds a namespace id and at least ``count`` keys."""
    extra = (len(meta) - NS_BYTES) // KEY_BYTES - count
    if extra < 0 or (len(meta) - NS_BYTES) % KEY_BYTES:
        raise ProtocolError(f"metadata of {len(meta)} bytes does not hold a namespace id and "
                            f"{count} keys")
    ns_id, keys = split_keys(meta, count + extra)
    return ns_id, keys[:count], keys[count:]


def pack_retain(ns_id: bytes, keys: Sequence[bytes], retention: dict[str, object]) -> bytes:
    """A RETAIN's metadata: namespace id, keys, then the retention as JSON."""
    return ns_id + b"".join(keys) + json.dumps(retention, separators=(",", ":")).encode()


def split_retain(meta: bytes | memoryview,
                 count: int) -> tuple[bytes, list[bytes], dict[str, object]]:
    """Inverse of pack_retain. Raises ProtocolError when the keys or the JSON object are
    not there."""
    end = NS_BYTES + count * KEY_BYTES
    if len(meta) < end:
        raise ProtocolError(f"RETAIN metadata of {len(meta)} bytes does not hold {count} keys")
    try:
        retention = json.loads(bytes(meta[end:]))
    except ValueError as exc:
        raise ProtocolError(f"RETAIN retention is not JSON: {exc}") from None
    if not isinstance(retention, dict):
        raise ProtocolError("RETAIN retention must be a JSON object")
    ns_id, keys = split_keys(meta[:end], count)
    return ns_id, keys, retention


def pack_flags(flags: list[bool]) -> bytes:
    """One byte per key, in key order: 1 = held, 0 = not (GET and EXISTS answers)."""
    return bytes(flags)


def parse_flags(meta: bytes, count: int) -> list[bool]:
    """Inverse of pack_flags. Raises ProtocolError unless ``meta`` is ``count`` bytes of 0/1."""
    if len(meta) != count or meta.translate(None, b"\x00\x01"):
        raise ProtocolError(f"flag answer of {len(meta)} bytes is not {count} bytes of 0/1")
    return [f == 1 for f in meta]


def error_for(status: int, message: str) -> RemoteError:
    """The exception a client raises for an error response."""
    try:
        st = Status(status)
    except ValueError:
        st = Status.INTERNAL
        message = f"unknown status {status}: {message}"
    if st in (Status.AUTH_FAILED, Status.AUTH_REQUIRED, Status.FORBIDDEN):
        return AuthError(st, message)
    if st is Status.PIN_LIMIT:
        return RemotePinLimitError(st, message)
    return RemoteError(st, message)


def answer_frame(req: Header, status: Status = Status.OK, count: int = 0, meta: bytes = b"",
                 payload: Sequence[memoryview] = ()) -> list[bytes | memoryview]:
    """The buffers of the answer to ``req``: header and metadata, then the payload views."""
    nbytes = sum(p.nbytes for p in payload)
    head = Header(req.op | RESPONSE_BIT, req.req_id, count, len(meta), nbytes, status)
    return [head.pack() + meta, *payload]
