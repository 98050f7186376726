"""Live configuration against real gateway processes: `serve --watch-config` follows a
saved file, and with `--processes 2` a SIGHUP to the supervisor reaches both serving
processes with their share; the change is seen by the next calls, and a call streaming
across the reload ends whole."""

from __future__ import annotations

import signal
from pathlib import Path

import grpc
from grpc import aio

from gateway_sim.client import channel, collect, model_md, sgl_generate, sgl_grpc, write_config
from gateway_sim.launch import Child, worker_url
from tests.support.helpers import logged_events
from tests.support.launch import Launcher
from tests.support.waits import until


async def prompt_code(gw: Child) -> grpc.StatusCode:
    """A call with a 3-token prompt (`sgl_generate`'s): OK, or why not."""
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        _, error = await collect(stub.Generate(sgl_generate("r"), metadata=model_md("m")))
    return grpc.StatusCode.OK if error is None else error.code()


def lower_the_limit(path: str) -> None:
    """The file saved again, `limits.max_prompt_tokens` 1000 -> 2."""
    Path(path).write_text(Path(path).read_text().replace("1000", "2"))


def config(worker: Child, max_prompt_tokens: int) -> dict[str, object]:
    return {
        "workers": [worker_url(worker, model="m", runtime="sglang")],
        "limits": {"max_prompt_tokens": max_prompt_tokens},
    }


async def test_a_saved_file_is_followed_while_a_stream_goes_on(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    worker = sim("--model", "m", "--token-ms", "10")
    path = write_config(tmp_path, config(worker, 1000))
    gw = gateway("--config", path, "--watch-config")
    assert await prompt_code(gw) is grpc.StatusCode.OK
    async with channel(gw.address) as ch:
        stream = sgl_grpc.SglangSchedulerStub(ch).Generate(
            sgl_generate("long", tokens=600), metadata=model_md("m")
        )
        assert await stream.read() is not aio.EOF
        lower_the_limit(path)
        await until(lambda: bool(logged_events(gw.log_path, "reloaded")))
        last = None
        while (message := await stream.read()) is not aio.EOF:
            last = message
        assert await stream.code() is grpc.StatusCode.OK
        assert last is not None and last.HasField("complete")
    (line,) = logged_events(gw.log_path, "reloaded")
    assert line["applied"] == ["limits.max_prompt_tokens"]
    assert await prompt_code(gw) is grpc.StatusCode.INVALID_ARGUMENT


async def test_sighup_reaches_every_serving_process(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    worker = sim("--model", "m")
    path = write_config(tmp_path, config(worker, 1000))
    gw = gateway("--config", path, "--processes", "2")
    assert await prompt_code(gw) is grpc.StatusCode.OK
    lower_the_limit(path)
    gw.process.send_signal(signal.SIGHUP)

    def processes_reloaded() -> set[object]:
        return {e.get("process") for e in logged_events(gw.log_path, "reloaded")}

    await until(lambda: processes_reloaded() == {"supervisor", "0", "1"})
    codes = [await prompt_code(gw) for _ in range(8)]  # the port spreads them over both
    assert set(codes) == {grpc.StatusCode.INVALID_ARGUMENT}
