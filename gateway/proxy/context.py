"""A call's context: what the gateway asks of whichever door a call came through.

Its own module because contexts come from several doors (grpc's servicer context, the
picker's `PickerContext`, the load report's `OrcaContext` wrapping another) and more
than the call reads them (the front, the load report, a job): these protocols are all
any of them must answer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, NoReturn, Protocol

import grpc

from gateway.proxy.metadata import Metadata


class Context(Protocol):
    """What the stages and a call's client side use of its context: grpc's servicer
    context has it all, and so do the stand-ins a call may come with (the picker's
    `PickerContext`, the load report's `OrcaContext`), so whichever door a call came
    through, the same stages run on it."""

    def invocation_metadata(self) -> Sequence[tuple[str, str | bytes]] | None: ...

    def peer(self) -> str: ...

    def auth_context(self) -> Mapping[str, Sequence[bytes]]: ...

    def time_remaining(self) -> float | None: ...

    def code(self) -> grpc.StatusCode | int | None: ...

    async def read(self) -> Any: ...

    def write(self, message: bytes) -> Awaitable[None]: ...

    async def send_initial_metadata(self, metadata: Metadata) -> None: ...

    def set_trailing_metadata(self, metadata: Metadata) -> None: ...

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Metadata = ()
    ) -> NoReturn: ...


class LoadTrailed(Protocol):
    """A context whose trailers end with the load report (`reporting.OrcaContext`)."""

    def end(self) -> None:
        """Set the trailers and the report, as the call ends."""
