"""What a Generate the picker placed used, read from its answer's last message (or each
message, as its engine counts: the call's client side says which) as the relay reads it
(`Downstream.relayed`), without the picker in the answer's path.

Envoy relays the answer. The picker marks the call in the answer that names its worker
(`gateway.picker` dynamic metadata: `answer` is `last` or `all`), and Envoy's Lua filter
(`answer_lua`, in `gateway envoy-config`'s bootstrap) keeps those messages as they pass
and hands them over in a trailer of the answer, whose trailers the picker reads anyway:
no message more on the picker's stream, and nothing more for Envoy to wait for. The
picker's answer to the trailers removes that trailer, so the client never sees it. With
the response body FULL_DUPLEX_STREAMED on the picker's filter (Istio, kgateway), every
piece of the answer passes the picker already, and is read as it passes instead.

Either way the messages are cut out of their gRPC frames (`frames`), each bounded, with
what every call's reader holds bounded together."""

from __future__ import annotations

import base64
import binascii
import contextlib

from gateway.picker import wire
from gateway.picker.answer_lua import MARK_KEY, MAX_BYTES, TRAILER
from gateway.picker.frames import Budget, Frames
from gateway.proxy import Downstream

MAX_MESSAGE_BYTES = 64 * 1024  # the longest message read (a Complete is far shorter)
MAX_HELD_BYTES = 32 * 1024 * 1024  # what every call's reader holds at once, per process

# The marks, by which messages are read, appended to the answer that names the worker.
MARKS = {reading: wire.metadata_patch({MARK_KEY: reading}) for reading in ("last", "all")}


class Answer:
    """One placed Generate's answer, read for its usage: its pieces as they pass (`body`),
    or the messages Envoy kept, from its trailers (`trailers`)."""

    __slots__ = ("_downstream", "_frames", "mark")

    def __init__(self, downstream: Downstream, reading: str, budget: Budget, kept: bool) -> None:
        """`kept`: Envoy keeps the messages (`mark` asks it to), else they pass here."""
        self._downstream = downstream
        self._frames = Frames(MAX_MESSAGE_BYTES, budget)
        self.mark = MARKS[reading] if kept else b""

    def body(self, piece: bytes) -> None:
        """A piece of the answer's body, passing the picker (FULL_DUPLEX_STREAMED)."""
        for message in self._frames.feed(piece):
            self._downstream.relayed(message)

    def trailers(self, trailers: wire.Headers) -> bytes:
        """The answer's trailers: the messages Envoy kept (none kept: the usage stays
        unknown), or the end of the body read piece by piece. Returns the picker's answer
        to them: Envoy's trailer removed, so the client never sees it."""
        if self._frames.partial:
            self._downstream.relayed(None)  # the body ended mid-message
        if not self.mark:
            return wire.GO_ON_RESPONSE_TRAILERS  # Envoy was asked to keep nothing
        kept = next((value for key, value in trailers if key == TRAILER), None)
        if kept is not None and len(kept) <= 2 * MAX_BYTES:
            # Not what Envoy's filter writes: the usage stays unknown.
            with contextlib.suppress(binascii.Error, ValueError):
                self.body(base64.b64decode(kept, validate=True))
            if self._frames.partial:
                self._downstream.relayed(None)
        return wire.trailers_without(TRAILER)

    def close(self) -> None:
        """The call ends: what the reader holds goes back."""
        self._frames.close()


class Answers:
    """Where the calls' answers are read, with the one budget their readers share."""

    __slots__ = ("budget",)

    def __init__(self, max_held: int = MAX_HELD_BYTES) -> None:
        self.budget = Budget(max_held)

    def open(self, downstream: Downstream | None, kept: bool) -> Answer | None:
        """The reader of a Generate's answer (None for other RPCs: no usage); `kept`:
        Envoy keeps its messages, else they pass the picker."""
        if downstream is None or downstream.reading is None:
            return None
        return Answer(downstream, downstream.reading, self.budget, kept)
