"""Helpers several tests share (no test imports another test module)."""

from __future__ import annotations

from collections.abc import Callable

from tests.sim.conftest import SimProcess

StartSim = Callable[..., SimProcess]
