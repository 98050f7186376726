"""A worker's TTFT model (gateway.upstream.latency) on synthetic data: it recovers the
costs it is shown, follows a worker that slows down, keeps a cost recent calls no longer
show, stays silent while cold, and refuses what no time to first token is."""

from __future__ import annotations

import random
import time

import pytest

from gateway.observability.record import CallRecord, PlacedOn
from gateway.upstream.latency import MIN_SEEN, LatencyModel, Lesson, lessons, ttft_features


def lesson(record: CallRecord) -> Lesson | None:
    (taught,) = lessons(record) or (None,)
    return taught


def ttft(uncached: int, load: float, speed: float = 1.0, backlog: int = 0) -> float:
    """20 ms, plus 80 us per uncached token (its own and those ahead) and 5 ms per call in
    flight, at `speed`."""
    return (0.020 + 80e-6 * (uncached + backlog) + 0.005 * load) / speed


def taught(model: LatencyModel, count: int, speed: float = 1.0, seed: int = 1) -> None:
    draw = random.Random(seed)
    for _ in range(count):
        uncached, load = draw.randrange(0, 4000), draw.randrange(0, 12)
        backlog = draw.randrange(0, 8000)
        seconds = ttft(uncached, load, speed, backlog) * draw.uniform(0.95, 1.05)
        model.observe(uncached, backlog, load, seconds)


def test_cold_until_enough_observations() -> None:
    model = LatencyModel()
    taught(model, MIN_SEEN - 1)
    assert model.predict(1000, 0, 2) is None
    taught(model, 1)
    assert model.predict(1000, 0, 2) is not None


@pytest.mark.parametrize(
    ("uncached", "backlog", "load"), [(500, 500, 1), (1000, 0, 2), (3500, 6000, 10), (200, 3000, 8)]
)
def test_it_recovers_the_costs_it_is_shown(uncached: int, backlog: int, load: int) -> None:
    model = LatencyModel()
    taught(model, 200)
    predicted = model.predict(uncached, backlog, load)
    expected = ttft(uncached, load, backlog=backlog)
    assert predicted is not None
    assert abs(predicted - expected) / expected < 0.1


def test_it_follows_a_worker_that_slows_down() -> None:
    model = LatencyModel()
    taught(model, 200)
    taught(model, 150, speed=0.5, seed=2)  # the worker now runs at half speed
    predicted = model.predict(2000, 1000, 4)
    expected = ttft(2000, 4, 0.5, 1000)
    assert predicted is not None
    assert abs(predicted - expected) / expected < 0.1


def test_a_cost_recent_calls_no_longer_show_is_kept_not_forgotten() -> None:
    """A worker that for hundreds of calls is sent only cache hits (the same few uncached
    tokens each) shows nothing of what a miss costs: its old observations fade, and the
    fit must keep the per-token cost it learned, not let it fade to 0. (It faded: after
    400 such calls a 1,408-token miss was predicted at 23 ms against a true 129, and the
    worker was sent whole prompts as if they were hits.)"""
    model = LatencyModel()
    taught(model, 40)
    draw = random.Random(3)
    for _ in range(400):
        load, backlog = draw.randrange(0, 8), draw.randrange(0, 200)
        model.observe(64, backlog, load, ttft(64, load, backlog=backlog))
    predicted = model.predict(1408, 0, 4)
    expected = ttft(1408, 4)
    assert predicted is not None
    assert abs(predicted - expected) / expected < 0.15
    hit = model.predict(64, 100, 4)
    assert hit is not None and abs(hit - ttft(64, 4, backlog=100)) / ttft(64, 4, backlog=100) < 0.1


def test_what_is_no_time_to_first_token_is_not_learned() -> None:
    model = LatencyModel()
    for bad in (-1.0, float("nan"), 1e9):
        model.observe(100, 0, 1, bad)
    model.observe(100, 0, float("inf"), 0.1)
    model.observe(-5, 0, 1, 0.1)
    model.observe(5, -1, 1, 0.1)
    model.observe_pace(float("nan"), 0.02)
    for bad_pace in (-1.0, float("nan"), 1e9):
        model.observe_pace(1, bad_pace)
    assert model.seen == 0
    taught(model, MIN_SEEN)
    assert model.predict_pace(1) is None  # no pace was learned


def test_a_lesson_comes_only_from_a_plain_successful_placed_call() -> None:
    record = CallRecord(rpc="Generate", service="s")
    record.worker, record.code, record.prompt_tokens = "w:1", "OK", 1000
    record.expected_cached_tokens, record.first_message_s = 600, 0.05
    record.placed_on = PlacedOn(load=3.0, backlog=900)
    assert lesson(record) is None  # one message: not streamed, the first is the last
    record.messages, record.started = 11, time.perf_counter() - 0.55  # 50 ms a message
    taught = lesson(record)
    assert taught is not None and taught[:5] == ("w:1", 400, 900, 3.0, 0.05)
    assert taught.pace_s is not None and 0.05 <= taught.pace_s < 0.06
    record.choices = 2  # its messages interleave two streams: no pace
    assert lesson(record) == (*taught[:5], None)
    record.choices, record.cached_tokens = 1, 700  # the engine's own count, when it says
    assert lesson(record)[:5] == ("w:1", 300, 900, 3.0, 0.05)  # type: ignore[index]
    record.retries = 1
    assert lesson(record) is None
    record.retries, record.code = 0, "UNAVAILABLE"
    assert lesson(record) is None
    record.code, record.placed_on = "OK", None
    assert lesson(record) is None


def test_the_pace_follows_the_running_batch() -> None:
    """Time per output token = 17.69 ms + 0.841 ms x calls running (a published fit)."""
    model = LatencyModel()
    draw = random.Random(3)
    for _ in range(100):
        load = draw.randrange(0, 60)
        model.observe_pace(load, (0.01769 + 0.000841 * load) * draw.uniform(0.97, 1.03))
    for load in (1, 20, 50):
        predicted = model.predict_pace(load)
        assert predicted is not None
        assert abs(predicted - (0.01769 + 0.000841 * load)) / predicted < 0.05


def test_stalls_the_features_do_not_explain_leave_the_usual_time() -> None:
    """One call in five stalls at ten times its time (a core taken, an engine hiccup):
    fitted by relative error, the prediction stays near the usual time, where the median
    of the observations is."""
    model = LatencyModel()
    draw = random.Random(4)
    for i in range(200):
        uncached, load = draw.randrange(0, 2000), draw.randrange(0, 4)
        seconds = ttft(uncached, load) * (10.0 if i % 5 == 0 else draw.uniform(0.95, 1.05))
        model.observe(uncached, 0, load, seconds)
    predicted = model.predict(1000, 0, 2)
    assert predicted is not None
    assert abs(predicted - ttft(1000, 2)) / ttft(1000, 2) < 0.25


def test_the_written_out_prediction_is_the_fits_over_the_features() -> None:
    """`LatencyModel.predict` writes the dot product out for speed: it stays the fit's own
    prediction over `ttft_features`, cold and warm."""
    model = LatencyModel()
    draw = random.Random(7)
    for i in range(3 * MIN_SEEN):
        uncached, backlog, load = draw.randrange(0, 4000), draw.randrange(0, 8000), i % 5
        written, fitted = (
            model.predict(uncached, backlog, load),
            model._ttft.predict(ttft_features(uncached, backlog, load)),
        )
        if i < MIN_SEEN:
            assert written is None and fitted is None
        else:
            assert written is not None and written == pytest.approx(fitted, rel=1e-12)
        model.observe(uncached, backlog, load, ttft(uncached, load, backlog=backlog))
