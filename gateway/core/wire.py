"""The protobuf wire format, just enough to cut a serialized message into pieces without
decoding it: where each field's record starts and ends. Used where decoding a whole
message would cost too much on the event loop (a long prompt's token ids, a worker's
large KV-event batch); malformed input raises protobuf's own DecodeError."""

from __future__ import annotations

from collections.abc import Iterator

from google.protobuf.message import DecodeError

VARINT, FIXED64, LENGTH_DELIMITED, FIXED32 = 0, 1, 2, 5


def varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    """The varint at `pos` and the position after it."""
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise DecodeError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise DecodeError("varint too long")


def encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if not value:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


def records(buf: bytes | memoryview, pos: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, record start, record end) of each field record in
    buf[pos:end]."""
    while pos < end:
        start = pos
        tag, pos = varint(buf, pos)
        kind = tag & 7
        if kind == VARINT:
            _, pos = varint(buf, pos)
        elif kind == FIXED64:
            pos += 8
        elif kind == LENGTH_DELIMITED:
            length, pos = varint(buf, pos)
            pos += length
        elif kind == FIXED32:
            pos += 4
        else:
            raise DecodeError(f"unsupported wire type {kind}")
        if pos > end:
            raise DecodeError("truncated record")
        yield tag >> 3, kind, start, pos


def payload(buf: bytes | memoryview, start: int) -> int:
    """Where a length-delimited record's payload starts (the record starting at `start`)."""
    _, pos = varint(buf, start)
    _, pos = varint(buf, pos)
    return pos
