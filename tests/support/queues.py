"""Helpers several tests share (no test imports another test module)."""

from __future__ import annotations

from gateway.flow.queue import FlowClass, FlowQueue

CLASSES = (
    FlowClass("interactive", ttl_s=30),
    FlowClass("standard", ttl_s=60),
    FlowClass("batch", ttl_s=300, starvation_s=60),
)


def held(q: FlowQueue) -> int:
    """Entries the queue's own tables hold, over every class."""
    return sum(
        len(state.lines)
        + len(state.arrivals)
        + len(state.finish)
        + len(state.spent)
        + len(state.by_tag)
        + len(state.by_age)
        + len(state.by_size)
        for state in q._state
    )
