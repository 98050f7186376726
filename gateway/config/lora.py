"""`lora:`: LoRA adapters (SGLang workers), placed where they are loaded, loaded on demand."""

from __future__ import annotations

import dataclasses

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

    adapters: dict[Name, Name] = dataclasses.field(default_factory=dict)
    max_loaded_per_worker: AtLeastOne = 4
    load_on_demand: Flag = True
    load_timeout_s: Interval = 30.0
    max_listed_per_worker: AtLeastOne = 256

    @property
    def enabled(self) -> bool:
        return bool(self.adapters)
