import pytest

from kvpool.errors import CorruptRecordError
from kvpool.record import (
    HEADER_SIZE,
    RecordHeader,
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
