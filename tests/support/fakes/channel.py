"""A channel that opens nothing: what a component given one needs when the test never
lets it call (a KV follower that is fed its batches by hand)."""

from __future__ import annotations

from typing import Any


class FakeChannel:
    def unary_stream(self, *args: Any, **kwargs: Any) -> None:
        return None
