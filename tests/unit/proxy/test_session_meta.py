"""The session a call names (affinity on): read once with the other metadata, bounded in
length, and the routing key of a call that has none of its own."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.placement.affinity import MAX_SESSION_KEY
from gateway.proxy.metadata import RequestMeta, read_request_meta


def read(metadata: Sequence[tuple[str, str | bytes]], session_header: str) -> RequestMeta:
    return read_request_meta(
        metadata,
        ("x-model-id",),
        "x-routing-key",
        "x-target-worker",
        frozenset(),
        ("", ""),
        session_header,
    )


def test_the_session_header_names_the_session_and_is_the_routing_key_without_one() -> None:
    meta = read([("x-session-id", "s1"), ("x-model-id", "m")], "x-session-id")
    assert (meta.session, meta.hints.routing_key, meta.model) == ("s1", "s1", "m")
    assert ("x-session-id", "s1") in meta.forward  # it travels upstream like any key


def test_an_own_routing_key_wins_and_affinity_off_reads_no_session() -> None:
    meta = read([("x-session-id", "s1"), ("x-routing-key", "k")], "x-session-id")
    assert (meta.session, meta.hints.routing_key) == ("s1", "k")
    off = read([("x-session-id", "s1")], "")
    assert (off.session, off.hints.routing_key) == (None, None)


def test_a_session_header_that_is_also_the_routing_key_header_is_both() -> None:
    meta = read([("x-routing-key", "s1")], "x-routing-key")
    assert (meta.session, meta.hints.routing_key) == ("s1", "s1")


def test_a_too_long_session_value_names_no_session() -> None:
    meta = read([("x-session-id", "x" * (MAX_SESSION_KEY + 1))], "x-session-id")
    assert (meta.session, meta.hints.routing_key, meta.bad_key) == (None, None, None)
