"""The picker's mode of the pipeline is derived from the relay's table: every stage of
the table runs in it but the one it names as replaced (dispatch, by the hand-over), and
a mode that names a stage the table lost fails at once."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.picker.stages import PickerStages
from gateway.proxy import stages
from gateway.proxy.stages import PIPELINE

REPLACED = {stages.dispatch}  # the relay's execution stage: the picker hands over instead


def picker_stages() -> PickerStages:
    hand_over: Any = object()  # not run here
    return PickerStages(hand_over, migrate_streams=False, count=lambda answer: None)


def test_every_stage_of_the_table_runs_in_the_pickers_mode_or_is_named_replaced() -> None:
    mode = picker_stages()
    sequence = (*mode.opening, *mode.placed)
    missing = [s.__name__ for s in PIPELINE if s not in sequence and s not in REPLACED]
    assert missing == []
    assert [s.__name__ for s in sequence] == [
        "open_call",
        "admit",
        "headers_read",
        "read",
        "decode",
        "resolve",
        "regular_only",
        "classify",
        "charge",
        "wait",
        "hand_over",
    ]


def test_a_mode_naming_a_stage_the_table_lacks_fails() -> None:
    async def elsewhere(env: Any, call: Any) -> None: ...

    with pytest.raises(ValueError, match="elsewhere"):
        stages.in_mode(stages.OPENING, after={elsewhere: elsewhere})
