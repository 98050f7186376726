"""Load-time patches for the real-engine tier's vLLM PD workers (put on their PYTHONPATH
only, by scripts/engines/worker.py; Python imports `sitecustomize` at start-up in every
process, vLLM's engine-core included). Pinned to the versions they patch: PyPI
nixl-cu12 1.5.1.

NIXL's progress thread: `nixl_agent` builds its agent with `pthrDelay = 0`, so the UCX
progress thread polls with no pause, a whole core per worker even when idle; on a 2-core
machine two such workers starve the engines (and the gateway). The patch sets the delay
to NIXL_PROGRESS_DELAY_US (the environment's, default 10,000 us) when the agent is made.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Sequence
from typing import Any

PATCHED = "nixl_cu12._api"
VERSION = "1.5.1"
DELAY_US = int(os.environ.get("NIXL_PROGRESS_DELAY_US", "10000"))


def _patch(module: types.ModuleType) -> None:
    bind = module.nixlBind  # type: ignore[attr-defined]

    class _Bind:
        """The bindings, but agents made with their progress thread's delay set."""

        def __getattr__(self, name: str) -> Any:
            return getattr(bind, name)

        @staticmethod
        def nixlAgent(name: str, config: Any) -> Any:
            config.pthrDelay = DELAY_US
            return bind.nixlAgent(name, config)

    module.nixlBind = _Bind()  # type: ignore[attr-defined]


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, name: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != PATCHED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


sys.meta_path.insert(0, _Finder())
