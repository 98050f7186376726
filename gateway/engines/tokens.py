"""A long prompt's token ids, read from the serialized request without protobuf.

Decoding a GenerateRequest with a million token ids costs ~25 ms in protobuf's parser,
which holds the GIL: on the event loop, twenty such requests stall every other call for
half a second, and a thread does not help. The ids are one packed field
(`tokenized.input_ids`, varints), so the front cuts that field's bytes out, decodes the
rest of the request with protobuf (small), and the ids with numpy, whose array work runs
without the GIL (`asyncio.to_thread`).

Only the one shape serializers produce is cut (the ids packed once, inside one
`tokenized` field); anything else is left to protobuf, so the answer is always the same
as a full decode.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

LENGTH_DELIMITED = 2
VARINT = 0
FIXED64, FIXED32 = 1, 5

Tokens = npt.NDArray[np.uint32]
TokenIds = Sequence[int] | Tokens  # a decoded request's repeated field, or these


class Unusual(Exception):
    """Not the one shape `split_tokens` handles: decode it the usual way."""


def _varint(data: bytes | memoryview, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise Unusual
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _fields(data: bytes | memoryview, start: int, end: int) -> list[tuple[int, int, int, int]]:
    """(field number, wire type, start of the field's tag, end of the field) for each
    field in data[start:end]; the value of a length-delimited field ends at its end."""
    found = []
    at = start
    while at < end:
        tag_at = at
        tag, at = _varint(data, at)
        number, wire = tag >> 3, tag & 7
        if wire == VARINT:
            _, at = _varint(data, at)
        elif wire == LENGTH_DELIMITED:
            length, at = _varint(data, at)
            at += length
        elif wire == FIXED64:
            at += 8
        elif wire == FIXED32:
            at += 4
        else:
            raise Unusual  # groups: not in these protocols
        if at > end:
            raise Unusual
        found.append((number, wire, tag_at, at))
    return found


def split_tokens(raw: bytes, outer: int, inner: int) -> tuple[bytes, Tokens]:
    """The request without its packed token ids (field `inner` of the message in field
    `outer`), and the ids. Raises Unusual for any other shape."""
    view = memoryview(raw)
    top = [f for f in _fields(view, 0, len(raw)) if f[0] == outer]
    if len(top) != 1 or top[0][1] != LENGTH_DELIMITED:
        raise Unusual
    _, _, tag_at, end = top[0]
    _, at = _varint(view, tag_at)
    length, content = _varint(view, at)
    fields = _fields(view, content, end)
    ids = [f for f in fields if f[0] == inner]
    if len(ids) != 1 or ids[0][1] != LENGTH_DELIMITED:
        raise Unusual  # absent, repeated, or unpacked
    _, _, ids_tag, ids_end = ids[0]
    _, at = _varint(view, ids_tag)
    ids_length, ids_start = _varint(view, at)
    tokens = decode_varints(view[ids_start:ids_end])
    kept = bytes(view[content:ids_tag]) + bytes(view[ids_end:end])
    rest = b"".join(
        (
            bytes(view[:tag_at]),
            _encode_varint(outer << 3 | LENGTH_DELIMITED),
            _encode_varint(len(kept)),
            kept,
            bytes(view[end:]),
        )
    )
    del length, ids_length
    return rest, tokens


def decode_varints(data: bytes | memoryview) -> Tokens:
    """Packed uint32 varints, vectorised: a value is the low seven bits of each of its
    (at most five) bytes, each shifted seven bits further; one gather per byte position,
    over the values (not the bytes), masked where a value is shorter."""
    raw = np.frombuffer(data, dtype=np.uint8)
    if raw.size == 0:
        return np.zeros(0, dtype=np.uint32)
    ends = np.flatnonzero(raw < 0x80)  # the last byte of each value
    if ends.size == 0 or ends[-1] != raw.size - 1:
        raise Unusual  # truncated
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    widths = ends - starts  # bytes after the first
    widest = int(widths.max())
    if widest > 4 or (widest == 4 and int(raw[ends[widths == 4]].max()) > 0x0F):
        raise Unusual  # wider than a uint32
    padded = np.concatenate((raw, np.zeros(widest, dtype=np.uint8)))
    values = (padded[starts] & 0x7F).astype(np.uint32)
    for k in range(1, widest + 1):
        part = (padded[starts + k] & 0x7F).astype(np.uint32)
        part *= widths >= k  # zero where the value ended before byte k
        part <<= np.uint32(7 * k)
        values |= part
    return values
