"""What of a worker's headers and trailers reaches the client: each entry weighed as
HTTP/2 and grpc core count it, the block cut to its bounds in order, the cut counted by
kind and logged at a bounded rate, a worker's failure keys left off an OK answer, and a
worker's status message bounded."""

from __future__ import annotations

from prometheus_client import generate_latest
from structlog.testing import capture_logs

from gateway.app.metrics import Metrics
from gateway.proxy.metadata import (
    CUT,
    HEADERS,
    MAX_RELAYED_DETAILS,
    TRAILERS,
    MetadataRelay,
    bounded,
    bounded_details,
    entry_size,
)
from tests.support.factories import make_registry


def pads(count: int, size: int = 256) -> tuple[tuple[str, str | bytes], ...]:
    """`count` entries of `size` bytes each, as HTTP/2 counts them."""
    keys = (f"x-pad-{i:03d}" for i in range(count))
    return tuple((key, "v" * (size - 32 - len(key))) for key in keys)


def test_an_entry_weighs_its_key_its_value_as_sent_and_32() -> None:
    assert entry_size("x-a", "hello") == 3 + 5 + 32
    assert entry_size("x-a", "é") == 3 + 2 + 32  # UTF-8 bytes
    assert entry_size("x-a-bin", b"\x00" * 6) == 7 + 8 + 32  # base64: 6 bytes -> 8
    assert entry_size("x-a-bin", b"\x00" * 7) == 7 + 10 + 32  # unpadded


def test_what_fits_is_kept_in_order_a_big_entry_dropped_smaller_ones_after_it_kept() -> None:
    small = pads(3, 100)
    big = (("x-big", "v" * 500),)
    metadata = small[:2] + big + small[2:]
    kept, dropped = bounded(metadata, max_bytes=400, max_entries=64)
    assert kept == small and dropped == 1


def test_the_count_is_bounded_too_and_a_block_that_fits_is_kept_as_it_is() -> None:
    metadata = pads(10, 50)
    kept, dropped = bounded(metadata, max_bytes=4096, max_entries=4)
    assert kept == metadata[:4] and dropped == 6
    kept, dropped = bounded(metadata, max_bytes=500, max_entries=10)
    assert kept is metadata and dropped == 0


def test_a_workers_14_kb_of_trailers_are_cut_to_the_bound_and_counted() -> None:
    relay = MetadataRelay(max_bytes=4096, max_entries=64)
    worker = pads(55)  # 14080 bytes: over grpc's soft limit of 8 KiB
    with capture_logs() as logs:
        kept = relay.trailers(worker, "w:1", failed=False)
    assert kept == worker[:16]  # 16 x 256 = 4096
    assert sum(entry_size(k, v) for k, v in kept) <= 4096
    assert relay.dropped == {HEADERS: 0, TRAILERS: 39}
    (line,) = logs
    assert line["event"] == "relayed_metadata_dropped"
    assert (line["kind"], line["worker"], line["dropped"], line["kept"]) == (
        TRAILERS,
        "w:1",
        39,
        16,
    )
    assert relay.headers(pads(70, 60), "w:1") == pads(64, 60)  # the entry bound
    assert relay.dropped == {HEADERS: 6, TRAILERS: 39}


def test_the_cut_is_logged_at_a_bounded_rate_and_counted_every_time() -> None:
    relay = MetadataRelay(max_bytes=256, max_entries=64)
    with capture_logs() as logs:
        for _ in range(50):
            relay.headers(pads(2), "w:1")
    assert relay.dropped[HEADERS] == 50
    assert 1 <= len(logs) <= 6  # a burst of 5, then one a second (this loop: well under 2 s)


def test_an_ok_answer_leaves_off_a_workers_failure_keys_a_failure_keeps_them() -> None:
    relay = MetadataRelay()
    worker = (
        ("x-http-status", "500"),
        ("grpc-status-details-bin", b"\x08\x0d"),
        ("x-kept", "1"),
        ("grpc-message", "x"),
        ("content-type", "application/grpc"),
    )
    assert relay.trailers(worker, "w:1", failed=False) == (("x-kept", "1"),)
    # A failure's x-http-status is relayed; grpc-* keys never are (grpc sets its own).
    assert relay.trailers(worker, "w:1", failed=True) == (("x-http-status", "500"), ("x-kept", "1"))
    assert relay.trailers(None, "w:1", failed=False) == ()
    assert relay.dropped == {HEADERS: 0, TRAILERS: 0}  # left off is not dropped for size


def test_nothing_is_relayed_with_bounds_of_zero() -> None:
    relay = MetadataRelay(max_bytes=0, max_entries=0)
    assert relay.headers((("x-a", "1"),), "w:1") == ()
    assert relay.dropped[HEADERS] == 1


def test_a_workers_status_message_is_bounded_in_utf8_bytes() -> None:
    assert bounded_details("simulated failure") == "simulated failure"
    long = bounded_details("x" * 5000)
    assert len(long.encode()) == MAX_RELAYED_DETAILS and long.endswith(CUT)
    wide = bounded_details("é" * 1000)  # 2000 bytes: cut on a character's boundary
    assert len(wide.encode()) <= MAX_RELAYED_DETAILS and wide.endswith(CUT)
    assert wide[:-3] == "é" * len(wide[:-3])
    assert bounded_details("é" * 10) == "é" * 10


def test_the_drops_are_a_metric_by_kind() -> None:
    relay = MetadataRelay(max_bytes=256)
    metrics = Metrics(make_registry())
    metrics.relayed_metadata(lambda: relay.dropped)
    relay.trailers(pads(3), "w:1", failed=False)
    text = generate_latest(metrics.prometheus).decode()
    assert 'gateway_relayed_metadata_dropped_total{kind="trailers"} 2.0' in text
    assert 'gateway_relayed_metadata_dropped_total{kind="headers"} 0.0' in text
