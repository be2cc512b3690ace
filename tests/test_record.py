import pytest

from kvpool.errors import CorruptRecordError
from kvpool.record import (
    FLAG_TOMBSTONE,
    HEADER_SIZE,
    RecordHeader,
    describes,
    payload_checksum,
    record_size,
    unpack_header,
)


def _header() -> RecordHeader:
    return RecordHeader(key=b"k" * 16, namespace_id=b"n" * 16, layout_id=7, payload_len=5000,
                        seq=42, checksum=payload_checksum(b"x" * 5000))


def test_roundtrip() -> None:
    h = _header()
    packed = h.pack()
    assert len(packed) == HEADER_SIZE
    assert unpack_header(packed) == h


def test_record_size_pads_to_blocks() -> None:
    assert record_size(0) == 4096
    assert record_size(1) == 8192
    assert record_size(65536) == 4096 + 65536


@pytest.mark.parametrize("offset", range(0, HEADER_SIZE, 7))
def test_any_flipped_bit_is_detected(offset: int) -> None:
    packed = bytearray(_header().pack())
    packed[offset] ^= 0x10
    with pytest.raises(CorruptRecordError):
        unpack_header(bytes(packed))


def test_zeroed_block_is_not_a_record() -> None:
    with pytest.raises(CorruptRecordError, match="magic"):
        unpack_header(bytes(4096))
    with pytest.raises(CorruptRecordError, match="short"):
        unpack_header(b"KVPR")


def _block(h: RecordHeader) -> memoryview:
    block = bytearray(4096)
    h.pack_into(block, 0)
    return memoryview(block)


PAYLOAD = memoryview(bytearray(b"x" * 5000))


def test_describes_a_valid_record_of_the_key_and_namespace() -> None:
    h = _header()
    assert describes(_block(h), 0, h.key, h.namespace_id, PAYLOAD)
    assert describes(_block(h), 0, h.key, None, PAYLOAD)  # no namespace asked


@pytest.mark.parametrize("what", ["key", "namespace", "length", "payload", "tombstone",
                                  "header byte", "zeroed"])
def test_describes_is_false_for_anything_else(what: str) -> None:
    """The lean check of a batched read: every way a record can be wrong reads as False
    (the caller then finds out why through the full checks)."""
    h = _header()
    key, ns, payload = h.key, h.namespace_id, PAYLOAD
    block = _block(h._replace(flags=FLAG_TOMBSTONE) if what == "tombstone" else h)
    if what == "key":
        key = b"q" * 16
    elif what == "namespace":
        ns = b"m" * 16
    elif what == "length":
        payload = PAYLOAD[:4999]
    elif what == "payload":
        payload = memoryview(bytearray(b"x" * 4999 + b"y"))
    elif what == "header byte":
        block[40] ^= 0x01  # the layout id, not compared: only the header checksum sees it
    elif what == "zeroed":
        block = memoryview(bytearray(4096))
    assert not describes(block, 0, key, ns, payload)
