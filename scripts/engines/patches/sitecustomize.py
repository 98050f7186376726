"""Load-time patches for the real-engine tier's PD workers (put on their PYTHONPATH only,
by scripts/engines/worker.py and sglang_worker.py; Python imports `sitecustomize` at
start-up in every process, vLLM's engine-core and SGLang's scheduler included). Each is
applied when its module is imported, and pinned to the version it patches:

- PyPI nixl-cu12 1.5.1, NIXL's progress thread (vLLM PD over NIXL): `nixl_agent` builds
  its agent with `pthrDelay = 0`, so the UCX progress thread polls with no pause, a whole
  core per worker even when idle; on a 2-core machine two such workers starve the
  engines (and the gateway). The patch sets the delay to NIXL_PROGRESS_DELAY_US (the
  environment's, default 10,000 us) when the agent is made.
- PyPI sglang 0.5.23, the Mooncake sender's page indices (SGLang PD over Mooncake): a
  prefill whose sender says `supports_host_tensor_indices` copies the KV page indices
  into pinned host memory, which needs an accelerator (`pin_memory=True requires a CUDA
  or other accelerator backend`: the scheduler dies at its first hand-off). The patch
  turns that off, so the sender gets the indices as every other backend does.
- PyPI sglang 0.5.23, the idle scheduler's nap (SGLang PD, run with `--sleep-on-idle`):
  an idle scheduler polls its request sockets for up to 1 s, but a PD leg also waits on
  what does not come through them (the decode's bootstrap, the KV transfer), so a
  hand-off waited up to a second now and then. The patch shortens the poll to
  SGLANG_IDLE_POLL_MS (the environment's, default 10 ms): still asleep when idle.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

DELAY_US = int(os.environ.get("NIXL_PROGRESS_DELAY_US", "10000"))
IDLE_POLL_MS = int(os.environ.get("SGLANG_IDLE_POLL_MS", "10"))


def _nixl_delay(module: types.ModuleType) -> None:
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


def _mooncake_indices(module: types.ModuleType) -> None:
    module.MooncakeKVSender.supports_host_tensor_indices = False  # type: ignore[attr-defined]


def _idle_poll(module: types.ModuleType) -> None:
    sleeper = module.IdleSleeper  # type: ignore[attr-defined]
    made = sleeper.__init__

    class _ShortPoll:
        """The sleeper's poller, but every poll at most IDLE_POLL_MS long."""

        def __init__(self, poller: Any) -> None:
            self._poller = poller

        def poll(self, timeout: Any = None) -> Any:
            return self._poller.poll(IDLE_POLL_MS)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._poller, name)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        self.poller = _ShortPoll(self.poller)

    sleeper.__init__ = __init__


PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "nixl_cu12._api": _nixl_delay,  # nixl-cu12 1.5.1
    "sglang.srt.disaggregation.mooncake.conn": _mooncake_indices,  # sglang 0.5.23
    "sglang.srt.managers.scheduler_components.idle_sleeper": _idle_poll,  # sglang 0.5.23
}


class _Loader(importlib.abc.Loader):
    def __init__(
        self, inner: importlib.abc.Loader, patch: Callable[[types.ModuleType], None]
    ) -> None:
        self._inner = inner
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        self._patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, name: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = PATCHES.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, patch)
        return spec


sys.meta_path.insert(0, _Finder())
