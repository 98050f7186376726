"""`lora:`: LoRA adapters (SGLang workers), placed where they are loaded, loaded on demand."""

from __future__ import annotations

from pydantic import Field
from pydantic.dataclasses import dataclass

from gateway.config.fields import SETTINGS, AtLeastOne, Flag, Interval, Name


@dataclass(frozen=True, slots=True, config=SETTINGS)
class LoraConfig:
    """Off unless `adapters` names some. A call naming an adapter (`lora_id`) goes to a
    worker that has it loaded; else, with `load_on_demand`, to one with room for it (or
    where the least recently used adapter no running call uses can be unloaded), where the
    gateway loads it from its path first (within `load_timeout_s`). `adapters`: adapter id
    -> its path on the workers; `max_loaded_per_worker`: how many the gateway lets one
    worker hold before it unloads one. A load that timed out is not tried on that worker
    again for `load_timeout_s`, doubling at each timeout in a row (at most 10 minutes),
    and counts as a failure in its outlier detection. `max_listed_per_worker`: the most
    adapters of one worker's list the gateway reads (a list past it counts as a rejected
    load figure); with `adapters` set, only those adapters are kept of it."""

    adapters: dict[Name, Name] = Field(
        default_factory=dict,
        description=(
            "LoRA adapter id -> its path on the workers (SGLang); empty: "
            "adapters are only preferred where held, never loaded or "
            "refused"
        ),
    )
    max_loaded_per_worker: AtLeastOne = Field(
        default=4,
        description=(
            "adapters one worker may hold before the gateway unloads its "
            "least recently used unused one"
        ),
    )
    load_on_demand: Flag = Field(
        default=True, description="load a call's adapter on the chosen worker when it lacks it"
    )
    load_timeout_s: Interval = Field(
        default=30.0, description="bound on one on-demand load (and the unload before it)"
    )
    max_listed_per_worker: AtLeastOne = Field(
        default=256,
        description=(
            "adapters read of one worker's list; the rest are ignored "
            "(counted as a rejected load figure)"
        ),
    )

    @property
    def enabled(self) -> bool:
        return bool(self.adapters)
