"""A call's latency objectives: header values checked and bounded, and whether observed
times met them."""

from __future__ import annotations

import pytest

from gateway.core.slo import MAX_SLO_MS, Slo, parse_ms
from gateway.proxy.metadata import read_request_meta

HEADERS = ("x-slo-ttft-ms", "x-slo-tpot-ms")


@pytest.mark.parametrize(
    ("value", "seconds"), [("250", 0.25), ("0.5", 0.0005), ("3600000", 3600.0), (" 40 ", 0.04)]
)
def test_a_positive_number_of_milliseconds_up_to_an_hour(value: str, seconds: float) -> None:
    assert parse_ms(value) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "value", ["", "0", "-1", "nan", "inf", "-inf", "1e9", "soon", "3600000.5", "1" * 17, "0x10"]
)
def test_anything_else_is_refused(value: str) -> None:
    assert parse_ms(value) is None
    assert MAX_SLO_MS == 3_600_000


def test_the_headers_are_read_and_the_first_bad_one_named() -> None:
    meta = read_request_meta(
        (("x-slo-ttft-ms", "300"), ("x-slo-tpot-ms", "25")), (), "", "", slo_headers=HEADERS
    )
    assert meta.slo == (0.3, 0.025) and meta.bad_slo is None
    meta = read_request_meta((("x-slo-tpot-ms", "fast"),), (), "", "", slo_headers=HEADERS)
    assert meta.slo == (None, None) and meta.bad_slo == "x-slo-tpot-ms"
    assert read_request_meta((), (), "", "", slo_headers=HEADERS).slo == (None, None)


def test_met_when_every_objective_stated_was_met() -> None:
    slo = Slo(ttft_s=0.3, tpot_s=0.02)
    assert slo.met(0.2, 0.01) is True
    assert slo.met(0.4, 0.01) is False
    assert slo.met(0.2, 0.03) is False
    assert slo.met(0.2, None) is None  # the pace of a one-message answer is unknown
    assert Slo(ttft_s=0.3).met(0.2, None) is True
