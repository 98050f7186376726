"""A client that stops reading: raw HTTP/2 (h2) that opens gRPC streams and never grants
them flow-control window, while it keeps draining its socket, so only HTTP/2 flow control
holds the data back (a gRPC client library would read ahead on its own)."""

from __future__ import annotations

import asyncio
import struct

import h2.config
import h2.connection
import h2.events
import h2.settings


class StalledClient:
    def __init__(self, host: str, port: int) -> None:
        self._host, self._port = host, port
        self._connection = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        self.received = 0  # DATA bytes that arrived (within the windows granted once)
        self.ended = 0  # streams that ended (reset or trailers)
        self._writer: asyncio.StreamWriter | None = None
        self._pump: asyncio.Task[None] | None = None

    async def open(self, path: str, request: bytes, metadata: dict[str, str], streams: int) -> None:
        reader, writer = await asyncio.open_connection(self._host, self._port)
        self._writer = writer
        conn = self._connection
        conn.local_settings = h2.settings.Settings(
            client=True, initial_values={h2.settings.SettingCodes.ENABLE_PUSH: 0}
        )
        conn.initiate_connection()
        framed = struct.pack(">BI", 0, len(request)) + request
        for _ in range(streams):
            stream = conn.get_next_available_stream_id()
            headers = [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", f"{self._host}:{self._port}"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                *metadata.items(),
            ]
            conn.send_headers(stream, headers)
            conn.send_data(stream, framed, end_stream=True)
        writer.write(conn.data_to_send())
        await writer.drain()
        self._pump = asyncio.ensure_future(self._read(reader, writer))

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = self._connection
        while data := await reader.read(65536):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    self.received += len(event.data)  # never acknowledged: no WINDOW_UPDATE
                elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                    self.ended += 1
            outgoing = conn.data_to_send()  # settings and ping acknowledgements only
            if outgoing:
                writer.write(outgoing)

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
        if self._writer is not None:
            self._writer.close()
