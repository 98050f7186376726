"""A response body's gRPC messages cut out of the pieces Envoy hands over: split anywhere,
a message past the bound stepped over without being held, bytes that are no framing the
end of the reading, and whatever is held given back to the shared budget."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from gateway.core.roles import Runtime
from gateway.engines import engine_adapters
from gateway.observability.record import CallRecord
from gateway.picker.frames import Budget, Frames
from gateway.picker.wire import framed
from gateway.proxy import Downstream
from tests.support.extproc import cut

MAX = 64


def read(frames: Frames, parts: list[bytes]) -> list[bytes | None]:
    return [message for part in parts for message in frames.feed(part)]


messages = st.lists(st.binary(max_size=MAX), max_size=8)


@given(messages, st.lists(st.integers(min_value=0), max_size=20))
def test_messages_come_out_whole_however_the_body_is_cut(
    sent: list[bytes], cuts: list[int]
) -> None:
    budget = Budget(10 * MAX)
    frames = Frames(MAX, budget)
    body = b"".join(framed(m) for m in sent)
    assert read(frames, cut(body, cuts)) == sent
    assert budget.held == (len(sent[-1]) if sent else 0)  # the last one may still be kept
    frames.close()
    assert budget.held == 0


@given(st.integers(min_value=0, max_value=3 * MAX), st.lists(st.integers(min_value=0)))
def test_a_message_past_the_bound_is_stepped_over_unheld(huge: int, cuts: list[int]) -> None:
    budget = Budget(10 * MAX)
    frames = Frames(MAX, budget)
    big = bytes(MAX + 1 + huge)
    body = framed(b"first") + framed(big) + framed(b"last")
    held = []
    got: list[bytes | None] = []
    for part in cut(body, cuts):
        got.extend(frames.feed(part))
        held.append(budget.held)
    assert got == [b"first", None, b"last"]
    assert max(held) <= len(b"first") + len(b"last")  # never the big one's bytes
    frames.close()
    assert budget.held == 0


def test_a_message_past_the_budget_or_compressed_is_stepped_over() -> None:
    budget = Budget(10)
    frames = Frames(MAX, budget)
    compressed = b"\x01" + framed(b"zz")[1:]
    body = framed(b"12345678") + framed(b"abcdefgh") + compressed + framed(b"ok")
    # The second does not fit beside the first, still kept; the compressed one is not read.
    assert frames.feed(body) == [b"12345678", None, None, b"ok"]
    assert budget.held == 2
    frames.close()
    assert budget.held == 0


def test_bytes_that_are_no_grpc_framing_end_the_reading() -> None:
    budget = Budget(10 * MAX)
    frames = Frames(MAX, budget)
    assert frames.feed(framed(b"one") + b"\x07junk" + framed(b"two")) == [b"one", None]
    assert frames.broken
    assert frames.feed(framed(b"three")) == []
    assert budget.held == 0


def test_a_message_cut_short_holds_only_what_came() -> None:
    budget = Budget(10 * MAX)
    frames = Frames(MAX, budget)
    assert frames.feed(framed(b"x" * 40)[:12]) == []
    assert frames.held == 40  # its length is taken as it begins: it may all come
    frames.close()  # the stream ended mid-message
    assert budget.held == 0 and frames.held == 0


def downstream(runtime: Runtime, stream: bool, choices: int = 1) -> tuple[Downstream, CallRecord]:
    record = CallRecord(rpc="Generate", service="s")
    tally = engine_adapters()[runtime].tally(stream, choices)
    return Downstream(Any, record, tally), record  # type: ignore[arg-type]


def sglang(kind: str, completion: int, index: int = 0) -> bytes:
    adapter = engine_adapters()[Runtime.SGLANG]
    response: Any = adapter.rpcs["Generate"].response_type()
    part = getattr(response, kind)
    part.completion_tokens, part.index = completion, index
    return bytes(response.SerializeToString())


def test_a_relayed_answer_is_read_as_the_relay_reads_it() -> None:
    # One choice's running totals: its last message says all.
    side, record = downstream(Runtime.SGLANG, stream=True)
    for message in (sglang("chunk", 1), None, sglang("chunk", 3), sglang("complete", 4)):
        side.relayed(message)
    side.tally()
    assert record.completion_tokens == 4
    # ... and the last one stepped over: unknown.
    side, record = downstream(Runtime.SGLANG, stream=True)
    side.relayed(sglang("chunk", 2))
    side.relayed(None)
    side.tally()
    assert record.completion_tokens is None
    # Two choices interleaved: every message is read; one stepped over: unknown.
    side, record = downstream(Runtime.SGLANG, stream=True, choices=2)
    for message in (sglang("chunk", 1, 0), sglang("complete", 2, 0), sglang("complete", 3, 1)):
        side.relayed(message)
    side.tally()
    assert record.completion_tokens == 5
    side, record = downstream(Runtime.SGLANG, stream=True, choices=2)
    for message in (sglang("complete", 2, 0), None, sglang("complete", 3, 1)):
        side.relayed(message)
    side.tally()
    assert record.completion_tokens is None
