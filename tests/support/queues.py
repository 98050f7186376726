"""Helpers several tests share (no test imports another test module)."""

from __future__ import annotations

from gateway.flow.queue import FlowClass

CLASSES = (
    FlowClass("interactive", ttl_s=30),
    FlowClass("standard", ttl_s=60),
    FlowClass("batch", ttl_s=300, starvation_s=60),
)
