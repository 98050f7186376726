"""A raw HTTP/2 gRPC client (h2) for what a gRPC library will not send: header values
grpc refuses (control characters, non-ASCII), streams that announce a message and send
only part of it, streams that send headers and nothing else. It drains its socket and
grants window, so only the gateway decides how much it takes."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings


@dataclass
class Stream:
    headers: dict[bytes, bytes] = field(default_factory=dict)  # response headers + trailers
    fields: list[tuple[bytes, bytes]] = field(default_factory=list)  # the same, repeats kept
    data: bytes = b""
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    reset: bool = False
    to_send: bytes = b""  # what is left to send as the window allows
    end_after: bool = False  # END_STREAM once `to_send` is out

    @property
    def status(self) -> int | None:
        raw = self.headers.get(b"grpc-status")
        return int(raw) if raw is not None else None

    @property
    def message(self) -> str:
        from urllib.parse import unquote

        return unquote(self.headers.get(b"grpc-message", b"").decode())


class RawClient:
    def __init__(self, host: str, port: int, source: str | None = None) -> None:
        self._host, self._port = host, port
        self._source = source  # the local address to connect from (another loopback one)
        self._conn = h2.connection.H2Connection(
            h2.config.H2Configuration(
                client_side=True,
                header_encoding=None,
                validate_outbound_headers=False,
                normalize_outbound_headers=False,
                validate_inbound_headers=False,
            )
        )
        self.streams: dict[int, Stream] = {}
        self.closed = asyncio.Event()
        self.greeted = asyncio.Event()  # the server's SETTINGS came: a transport holds it
        self.error: Exception | None = None  # why the connection ended, if it failed
        self._writer: asyncio.StreamWriter | None = None
        self._pump: asyncio.Task[None] | None = None

    async def connect(self) -> None:
        local = (self._source, 0) if self._source else None
        reader, writer = await asyncio.open_connection(self._host, self._port, local_addr=local)
        self._writer = writer
        self._conn.local_settings = h2.settings.Settings(
            client=True,
            initial_values={
                h2.settings.SettingCodes.ENABLE_PUSH: 0,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1 << 24,
            },
        )
        self._conn.initiate_connection()
        self._conn.increment_flow_control_window(1 << 30)
        self._flush()
        self._pump = asyncio.ensure_future(self._read(reader))

    def open(
        self,
        path: str,
        metadata: list[tuple[bytes, bytes]],
        message: bytes | None = None,
        *,
        announce: int | None = None,
        end: bool = True,
    ) -> Stream:
        """Open a stream; `message` (framed as one gRPC message, its length `announce` if
        given) goes out as the gateway grants window; END_STREAM after it if `end`."""
        conn = self._conn
        stream_id = conn.get_next_available_stream_id()
        headers = [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path.encode()),
            (b":authority", f"{self._host}:{self._port}".encode()),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
            *metadata,
        ]
        stream = self.streams[stream_id] = Stream()
        conn.send_headers(stream_id, headers, end_stream=message is None and end)
        if message is not None:
            length = len(message) if announce is None else announce
            stream.to_send = struct.pack(">BI", 0, length) + message
            stream.end_after = end
        self._send_pending()
        return stream

    def _send_pending(self) -> None:
        conn = self._conn
        for stream_id, stream in self.streams.items():
            while stream.to_send and not stream.ended.is_set():
                try:
                    window = conn.local_flow_control_window(stream_id)
                except h2.exceptions.StreamClosedError:
                    stream.to_send = b""
                    break
                size = min(window, conn.max_outbound_frame_size, len(stream.to_send))
                if size <= 0:
                    break
                chunk, stream.to_send = stream.to_send[:size], stream.to_send[size:]
                conn.send_data(stream_id, chunk, end_stream=stream.end_after and not stream.to_send)
        self._flush()

    @property
    def unsent(self) -> int:
        return sum(len(s.to_send) for s in self.streams.values())

    def _flush(self) -> None:
        data = self._conn.data_to_send()
        if data and self._writer is not None and not self._writer.is_closing():
            self._writer.write(data)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        conn = self._conn
        try:
            while data := await reader.read(1 << 20):
                for event in conn.receive_data(data):
                    stream = self.streams.get(getattr(event, "stream_id", 0) or 0)
                    if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                        if stream is not None:
                            stream.headers.update(dict(event.headers))
                            stream.fields += event.headers
                    elif isinstance(event, h2.events.DataReceived):
                        conn.acknowledge_received_data(
                            event.flow_controlled_length, event.stream_id
                        )
                        if stream is not None:
                            stream.data += event.data
                    elif isinstance(event, h2.events.StreamEnded):
                        if stream is not None:
                            stream.ended.set()
                    elif isinstance(event, h2.events.StreamReset) and stream is not None:
                        stream.reset = True
                        stream.ended.set()
                    elif isinstance(event, h2.events.RemoteSettingsChanged):
                        self.greeted.set()
                self._send_pending()
        except (ConnectionError, h2.exceptions.ProtocolError) as exc:
            self.error = exc
        finally:
            for stream in self.streams.values():
                stream.ended.set()
            self.closed.set()

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
