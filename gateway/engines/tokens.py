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
from google.protobuf.message import DecodeError

from gateway.core.wire import LENGTH_DELIMITED, encode_varint, payload, records

Tokens = npt.NDArray[np.uint32]
TokenIds = Sequence[int] | Tokens  # a decoded request's repeated field, or these


class Unusual(Exception):
    """Not the one shape `split_tokens` handles: decode it the usual way."""


def split_tokens(raw: bytes, outer: int, inner: int) -> tuple[bytes, Tokens]:
    """The request without its packed token ids (field `inner` of the message in field
    `outer`), and the ids. Raises Unusual for any other shape."""
    view = memoryview(raw)
    try:
        top = [r for r in records(view, 0, len(raw)) if r[0] == outer]
        if len(top) != 1 or top[0][1] != LENGTH_DELIMITED:
            raise Unusual
        _, _, start, end = top[0]
        content = payload(view, start)
        ids = [r for r in records(view, content, end) if r[0] == inner]
        if len(ids) != 1 or ids[0][1] != LENGTH_DELIMITED:
            raise Unusual  # absent, repeated, or unpacked
        _, _, ids_start, ids_end = ids[0]
        tokens = decode_varints(view[payload(view, ids_start) : ids_end])
    except DecodeError:
        raise Unusual from None
    kept = bytes(view[content:ids_start]) + bytes(view[ids_end:end])
    rest = b"".join(
        (
            bytes(view[:start]),
            encode_varint(outer << 3 | LENGTH_DELIMITED),
            encode_varint(len(kept)),
            kept,
            bytes(view[end:]),
        )
    )
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


def highest(tokens: TokenIds) -> int:
    """The largest token id of a prompt (-1 for none): what a vocabulary bound is checked
    against. numpy's max for the ids cut out of a long request (no GIL), Python's for a
    decoded field (short: under SPLIT_MIN_BYTES of ids)."""
    if isinstance(tokens, np.ndarray):
        return int(tokens.max()) if tokens.size else -1
    return max(tokens, default=-1)
