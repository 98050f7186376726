"""The attack harness's pure parts (scripts/attacks): the prober's stalls, the legitimate
client's figures, and the pass criteria of a scenario's outcome."""

from __future__ import annotations

import math

import pytest

from scripts.attacks.measure import call_stats, stalls
from scripts.attacks.outcome import Check, Outcome, table_line


def test_a_stall_is_the_gap_beyond_the_probe_interval() -> None:
    # Answers every 20 ms, then one 520 ms after the one before: a 500 ms stall.
    replies = [0.021, 0.041, 0.561, 0.581]
    assert [round(g, 3) for g in stalls(0.0, replies, 0.020)] == [0.001, 0.0, 0.5, 0.0]


def test_call_stats_count_codes_and_take_percentiles_of_every_call() -> None:
    calls = [(0.001 * (i + 1), "OK") for i in range(98)] + [(1.0, "UNAVAILABLE")] * 2
    stats = call_stats("attack", calls)
    assert (stats["calls"], stats["ok"]) == (100, 98)
    assert stats["codes"] == {"OK": 98, "UNAVAILABLE": 2}
    assert stats["p50_ms"] == pytest.approx(51.0)
    assert stats["p99_ms"] == pytest.approx(1000.0)
    assert math.isnan(call_stats("none", [])["p99_ms"])


def outcome(ok: int, p99_ms: float, stall_ms: float, rss_after: float) -> Outcome:
    base = {"calls": 100, "ok": 100, "codes": {"OK": 100}, "p50_ms": 2.0, "p99_ms": 10.0}
    attack = {**base, "ok": ok, "p99_ms": p99_ms}
    health = {"checks": 500, "failed": 0, "max_ms": stall_ms, "p99_ms": 1.0}
    return Outcome(
        "flow-queue",
        "an attack",
        legit=(base, attack),
        health=(health, health),
        rss_mib=(80.0, 150.0, rss_after),
        threads=(12, 13, 12),
        checks=[Check("hosts joined", "15 of 15", True), Check("shown only", "x")],
    )


def test_each_criterion_passes_at_its_bound_and_fails_past_it() -> None:
    at_bounds = outcome(ok=99, p99_ms=20.0, stall_ms=100.0, rss_after=100.0)
    assert [c.passed for c in at_bounds.criteria()] == [True, True, True, True, True]
    past = outcome(ok=98, p99_ms=20.1, stall_ms=100.1, rss_after=100.1)
    assert [c.passed for c in past.criteria()] == [False, False, False, False, True]


def test_a_table_line_shows_each_verdict_and_a_skipped_scenario_says_why() -> None:
    line = table_line(outcome(ok=100, p99_ms=30.0, stall_ms=5.0, rss_after=81.0))
    assert "PASS FAIL PASS PASS" in line
    assert "hosts joined 15 of 15 PASS" in line and "shown only" not in line
    skipped = Outcome("trailers", "a worker's trailers", skipped="no knob")
    assert skipped.criteria() == [] and "SKIPPED: no knob" in table_line(skipped)
