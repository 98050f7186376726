"""A throwaway policy plugin, written into a directory for a test: its modules and an
installed distribution's metadata (`*.dist-info/METADATA` and `entry_points.txt`), so
with the directory on the path `importlib.metadata` finds it as any installed plugin."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from gateway.core.policy_names import GROUP

# A policy that always picks the candidate whose id sorts last: unlike every built-in,
# it sends every call to the same worker, whatever the load.
LAST_ID = """
from gateway.placement.policies import Policy


class LastId(Policy):
    name = "last_id"

    def pick(self, candidates, hints):
        return max(candidates, key=lambda c: c.id) if candidates else None
"""


def write_plugin(
    directory: Path, dist: str, entries: Mapping[str, str], modules: Mapping[str, str]
) -> Path:
    """`entries`: policy name -> `module:Class`; `modules`: module name -> source."""
    for module, source in modules.items():
        (directory / f"{module}.py").write_text(source)
    info = directory / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entries.items())
    (info / "entry_points.txt").write_text(f"[{GROUP}]\n{lines}")
    return directory
