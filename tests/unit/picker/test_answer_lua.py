"""The Lua Envoy runs on the answers the picker marked (gateway/picker/answer_lua.py), run
here in LuaJIT (lupa: the interpreter Envoy embeds) against a stand-in for Envoy's stream
handle: the response body's chunks split anywhere, frames past the bound stepped over
without being copied, bytes that are no gRPC framing, and the trailer it leaves the picker
(which reads it with the picker's own frame reader)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given
from hypothesis import strategies as st
from lupa import luajit21

from gateway.picker.answer_lua import MAX_BYTES, SOURCE, TRAILER
from gateway.picker.frames import Budget, Frames
from gateway.picker.wire import framed
from tests.support.extproc import cut

HANDLE = b"""
function(mark, chunks, trailers, copied)
  local handle = {}
  function handle:streamInfo()
    return {dynamicMetadata = function()
      return {get = function(_, namespace)
        if namespace == "gateway.picker" and mark then return {answer = mark} end
      end}
    end}
  end
  function handle:bodyChunks()
    local i = 0
    return function()
      i = i + 1
      local chunk = chunks[i]
      if chunk == nil then return nil end
      return {
        length = function() return #chunk end,
        getBytes = function(_, at, n)
          assert(at >= 0 and n >= 0 and at + n <= #chunk, "out of the chunk")
          copied[1] = copied[1] + n
          return string.sub(chunk, at + 1, at + n)
        end,
      }
    end
  end
  function handle:trailers()
    if trailers == nil then return nil end
    return {
      add = function(_, k, v) trailers[k] = v end,
      remove = function(_, k) trailers[k] = nil end,
    }
  end
  function handle:base64Escape(s) return "b64:" .. s end
  envoy_on_response(handle)
end
"""


@dataclass
class Run:
    trailers: dict[bytes, bytes] | None
    copied: int  # body bytes the script had Envoy copy out
    sent: list[bytes] = field(default_factory=list)

    @property
    def kept(self) -> bytes | None:
        """The frames the trailer carries (base64Escape stands in as `b64:` + bytes)."""
        assert self.trailers is not None
        value = self.trailers.get(TRAILER.encode())
        return None if value is None else value.removeprefix(b"b64:")


def respond(
    chunks: list[bytes], mark: str | None = "last", trailers: dict[str, str] | None = None
) -> Run:
    lua = luajit21.LuaRuntime(encoding=None)
    lua.execute(SOURCE.encode())
    left = (
        None
        if trailers is None
        else lua.table_from({k.encode(): v.encode() for k, v in trailers.items()})
    )
    copied = lua.table_from([0])
    lua.eval(HANDLE)(mark.encode() if mark else None, lua.table_from(chunks), left, copied)
    after = None if left is None else {bytes(k): bytes(v) for k, v in left.items()}
    return Run(after, int(copied[1]))


def messages_of(frames: bytes) -> list[bytes | None]:
    reader = Frames(MAX_BYTES, Budget(MAX_BYTES))
    return reader.feed(frames)


bodies = st.lists(st.binary(max_size=300), min_size=1, max_size=8)


@given(bodies, st.lists(st.integers(min_value=0), max_size=24))
def test_the_last_message_whole_however_the_chunks_cut_it(
    sent: list[bytes], cuts: list[int]
) -> None:
    body = b"".join(framed(m) for m in sent)
    run = respond(cut(body, cuts), trailers={"grpc-status": "0"})
    assert run.kept == framed(sent[-1])
    assert messages_of(run.kept) == [sent[-1]]


@given(bodies, st.lists(st.integers(min_value=0), max_size=24))
def test_every_message_whole_when_each_counts(sent: list[bytes], cuts: list[int]) -> None:
    body = b"".join(framed(m) for m in sent)
    run = respond(cut(body, cuts), mark="all", trailers={"grpc-status": "0"})
    assert run.kept == body
    assert messages_of(body) == sent


def test_a_frame_past_the_bound_is_stepped_over_uncopied() -> None:
    huge = bytes(MAX_BYTES + 1)
    body = framed(b"first") + framed(huge) + framed(b"last")
    chunks = cut(body, list(range(0, len(body), 4096)))
    run = respond(chunks, trailers={})
    assert run.kept == framed(b"last")
    assert run.copied < 100  # prefixes and the kept frames: never the huge one's bytes
    # The huge one last: no usage (the one before it is not the last).
    assert respond(cut(framed(b"first") + framed(huge), [7]), trailers={}).kept is None
    # Each message counting: one missing, none.
    assert respond(chunks, mark="all", trailers={}).kept is None


def test_every_message_past_the_bound_together_is_none() -> None:
    half = bytes(MAX_BYTES // 2)
    assert respond([framed(half) + framed(half)], mark="all", trailers={}).kept is None
    assert respond([framed(half) + framed(half)], mark="last", trailers={}).kept == framed(half)


def test_compressed_frames_are_not_kept() -> None:
    compressed = b"\x01" + framed(b"zz")[1:]
    assert respond([compressed + framed(b"ok")], trailers={}).kept == framed(b"ok")
    assert respond([framed(b"ok") + compressed], trailers={}).kept is None
    assert respond([framed(b"ok") + compressed], mark="all", trailers={}).kept is None


def test_bytes_that_are_no_grpc_framing_leave_no_trailer() -> None:
    worker_sent = {"grpc-status": "0", TRAILER: "forged"}
    run = respond([framed(b"one") + b"\x07junk" + framed(b"two")], trailers=worker_sent)
    assert run.trailers == {b"grpc-status": b"0"}  # the worker's own is removed too
    cut_short = respond([framed(b"one") + framed(b"two")[:-1]], trailers={})
    assert cut_short.kept is None


def test_unmarked_calls_and_answers_without_trailers_are_left_alone() -> None:
    body = [framed(b"one")]
    worker_sent = {"grpc-status": "0", TRAILER: "theirs"}
    untouched = respond(body, mark=None, trailers=worker_sent)
    assert untouched.trailers == {k.encode(): v.encode() for k, v in worker_sent.items()}
    assert untouched.copied == 0
    assert respond(body, trailers=None).trailers is None  # a reset stream: no trailers
    assert respond([], trailers={}).kept is None  # headers and trailers, no message
    assert respond([framed(b"")], trailers={}).kept == framed(b"")  # an empty message
