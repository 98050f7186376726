"""`gateway check-config` as a process: exit 0 with the effective configuration, exit 2
with the very line `gateway serve` prints for the files serve reads at start-up (API
keys, certificates); and it binds nothing and starts nothing: ports serve cannot take
do not stop it, and nothing it names (workers, a trace collector) is connected to.
(Every other kind of error, in process: tests/unit/cli/test_check_config.py.)"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.support.availability import run_cli

# serve's flags as the tests run it (every port free), but plain console logs.
PORTS = ("--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--metrics-listen", "off")


@pytest.fixture
def listening() -> Iterator[socket.socket]:
    """A port something already listens on: connections to it wait in its backlog."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock
    sock.close()


def config_file(tmp_path: Path, data: Mapping[str, object]) -> str:
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_a_valid_configuration_exits_0_with_its_effective_yaml(tmp_path: Path) -> None:
    path = config_file(tmp_path, {"max_attempts": 4, "admin": {"token": "hunter2"}})
    result = run_cli("check-config", path, "--policy", "least_inflight")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    shown = yaml.safe_load(result.stdout)
    assert (shown["max_attempts"], shown["default_policy"]) == (4, "least_inflight")
    assert shown["admin"]["token"] == "***"
    assert "hunter2" not in result.stdout


def test_files_serve_reads_at_start_up_fail_with_the_line_serve_prints(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing")
    cases = {
        "api keys": ["--config", config_file(tmp_path, {"auth": {"api_keys_file": missing}})],
        "certificate": ["--tls-cert", missing, "--tls-key", missing],
        "token file": ["--admin-token-file", missing],
    }
    runs = [(verb, args) for args in cases.values() for verb in ("check-config", "serve")]
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        results = list(pool.map(lambda run: run_cli(run[0], *PORTS, *run[1]), runs))
    by_case = dict(zip(cases, zip(results[::2], results[1::2], strict=True), strict=True))
    for case, (checked, served) in by_case.items():
        assert (checked.returncode, served.returncode) == (2, 2), case
        assert checked.stdout == served.stdout == "", case
        [line] = checked.stderr.splitlines()
        assert line.startswith("gateway: config error: "), case
        assert missing in line, case
        assert checked.stderr == served.stderr, case


def test_it_binds_nothing_and_connects_to_nothing(tmp_path: Path, listening: socket.socket) -> None:
    """Every address the configuration names is a port already taken: serve cannot
    listen there, check-config passes; and none of the workers or collector it names
    saw a connection (its backlog is empty once check-config exited)."""
    taken = f"127.0.0.1:{listening.getsockname()[1]}"
    data = {
        "listen": taken,
        "admin": {"listen": taken},
        "metrics": {"listen": taken},
        "workers": [f"grpc://{taken}"],  # no model, runtime: serve would ask the worker
        "tracing": {"endpoint": f"http://{taken}"},
    }
    path = config_file(tmp_path, data)
    checked = run_cli("check-config", path)
    assert checked.returncode == 0, checked.stderr
    assert yaml.safe_load(checked.stdout)["listen"] == taken
    listening.setblocking(False)
    with pytest.raises(BlockingIOError):
        listening.accept()  # nobody connected
    served = run_cli("serve", "--config", path, "--drain-delay", "0")
    assert served.returncode == 2
    assert served.stderr.startswith(f"gateway: cannot listen on {taken}: "), served.stderr
