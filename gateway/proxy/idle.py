"""Stream idle timeout: a stream on which no message moved for a while is ended.

A client that stops reading (so writes stop completing) and a worker that stops sending
both leave a stream that holds a slot, a worker's attention and memory while nothing
happens. Each call runs under one deadline of its own (the front's: the read timeout
until its request is read); a stream's is then left unset, and nothing is done per
message or per call here but a dict entry. One process-wide look every half period notes
each stream whose message count changed since the last look, and ends (its deadline set
to now) each one on which nothing moved for the whole period: an idle stream ends
between 1 and 1.5 periods after its last message. A look at many streams is cut into
slices, so the event loop never runs one for long.
"""

from __future__ import annotations

import asyncio

from gateway.observability.record import CallRecord

SLICE = 512  # streams looked at per event-loop turn


class StreamIdle(Exception):
    """No message moved on the stream for the configured time."""

    def __init__(self, idle_s: float) -> None:
        super().__init__(f"Stream idle for {idle_s:g} s: no message moved either way")


class _Seen:
    """A stream's message count at the last look, and when it last changed (loop time)."""

    __slots__ = ("count", "moved_at", "record")

    def __init__(self, record: CallRecord, now: float) -> None:
        self.record, self.count, self.moved_at = record, record.messages, now


class IdleWatch:
    """The streams of one serving process, each with the deadline that ends it idle.
    Its timer runs only while some stream is watched."""

    __slots__ = ("_due", "_looking", "_loop", "_streams", "idle_s")

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s  # 0: off
        self._streams: dict[asyncio.Timeout, _Seen] = {}
        self._due: list[tuple[asyncio.Timeout, _Seen]] = []  # what this look has left
        self._looking: asyncio.Handle | None = None  # the next look, or the next slice
        self._loop: asyncio.AbstractEventLoop | None = None

    def configure(self, idle_s: float) -> None:
        """A reload: streams that open from now are ended idle after `idle_s` (0: never);
        those watched keep being looked at."""
        self.idle_s = idle_s

    def watch(self, record: CallRecord, limit: asyncio.Timeout) -> None:
        """From now, `limit` ends the stream once no message moved on it for `idle_s`."""
        loop = self._loop = asyncio.get_running_loop()
        limit.reschedule(None)
        self._streams[limit] = _Seen(record, loop.time())
        if self._looking is None:
            self._looking = loop.call_later(self._period_s, self._look)

    @property
    def _period_s(self) -> float:
        """How often the watched streams are looked at: half the idle timeout (a second's
        half while a reload has turned it off and streams are still watched)."""
        return (self.idle_s or 1.0) / 2

    def forget(self, limit: asyncio.Timeout) -> None:
        self._streams.pop(limit, None)

    def __len__(self) -> int:
        return len(self._streams)

    def _look(self) -> None:
        self._due = list(self._streams.items())
        self._slice()

    def _slice(self) -> None:
        loop = self._loop
        assert loop is not None
        due, self._due = self._due[:SLICE], self._due[SLICE:]
        now = loop.time()
        # Turned off by a reload while streams were watched: none of them ends idle.
        idle_since = now - self.idle_s if self.idle_s > 0 else float("-inf")
        streams = self._streams
        for limit, seen in due:
            count = seen.record.messages
            if count != seen.count:
                seen.count, seen.moved_at = count, now
            elif seen.moved_at <= idle_since and limit in streams and not limit.expired():
                limit.reschedule(now)  # ends it: the handler's deadline has passed
        if self._due:
            self._looking = loop.call_soon(self._slice)
        elif streams:
            self._looking = loop.call_later(self._period_s, self._look)
        else:
            self._looking = None

    def close(self) -> None:
        if self._looking is not None:
            self._looking.cancel()
            self._looking = None
        self._streams.clear()
        self._due = []
