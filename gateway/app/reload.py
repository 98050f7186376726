"""Live configuration: SIGHUP, and with `--watch-config` a changed file, read the config
again and put the keys that reload in force (`gateway.config.reload` says which), while
every call goes on. One reload runs at a time; a request during one runs it once more
after. The file is read and checked off the event loop; a file that does not check out
changes nothing (logged, the config in force serves on)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from gateway.config import ConfigError, GatewayConfig
from gateway.config.reload import Reload, reload
from gateway.core.files import stamp
from gateway.core.tasks import TaskScope

log = structlog.get_logger("gateway")

WATCH_INTERVAL_S = 1.0  # `--watch-config`: the file is looked at this often

Reread = Callable[[], GatewayConfig]  # the file (and the flags) read and checked again
Apply = Callable[[Reload | None], object]  # after each attempt (None: no config was read)


class Reloader:
    """Runs reloads for one process: `running()` is the config in force, `reread` reads
    the new one (None: there is no file, SIGHUP reads only the certificate and key
    files), `apply` puts a reload in force (and reads those files)."""

    def __init__(
        self, running: Callable[[], GatewayConfig], reread: Reread | None, apply: Apply
    ) -> None:
        self._running, self._reread, self._apply = running, reread, apply
        self._scope = TaskScope()
        self._busy = False
        self._again = False

    @property
    def running(self) -> bool:
        """A reload is under way (or due again)."""
        return self._busy

    def request(self) -> None:
        """A reload, soon (from a signal handler or the file watch: returns at once)."""
        if self._busy:
            self._again = True
            return
        self._busy = True
        self._scope.spawn(self._run(), "config_reload")

    async def _run(self) -> None:
        try:
            while True:
                self._again = False
                self._apply(await self._read())
                if not self._again:
                    return
        finally:
            self._busy = False

    async def _read(self) -> Reload | None:
        if self._reread is None:
            return None
        try:
            read = await asyncio.get_running_loop().run_in_executor(None, self._reread)
            done = reload(self._running(), read)
        except (ConfigError, ValueError) as exc:  # ValueError: pydantic's, on the mixture
            log.error("config_reload_failed", error=str(exc), note="the config in force serves on")
            return None
        if done.need_restart:
            log.warning(
                "config_needs_restart",
                keys=list(done.need_restart),
                note="changed in the file; read at start-up only",
            )
        return done

    async def watch(self, path: str, interval_s: float = WATCH_INTERVAL_S) -> None:
        """Until cancelled: a reload each time the file at `path` changes (its `stamp`:
        an edit in place, an editor's or a ConfigMap's replacement)."""
        seen = stamp(path)
        while True:
            await asyncio.sleep(interval_s)
            now = stamp(path)
            if now != seen and now is not None:
                seen = now
                log.info("config_file_changed", path=path)
                self.request()

    def spawn_watch(self, path: str) -> None:
        self._scope.spawn(self.watch(path), "config_watch")

    async def close(self) -> None:
        await self._scope.close()
