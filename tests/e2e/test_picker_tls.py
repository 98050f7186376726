"""The picker port's transport security, with real processes: a gateway whose main port
requires mTLS serves its picker port with the same TLS and client-certificate
requirement (no plaintext, no TLS client without a certificate gets an answer), a real
Envoy configured by `gateway envoy-config --picker-ca/--picker-cert/--picker-key`
reaches it and routes a Generate to its worker, and a picker port past loopback without
TLS is refused at start in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import trustme
from grpc import aio

from gateway.picker.envoy import PickerTls, envoy_config
from gateway_sim.client import SGL, channel, collect, model_md, sgl_generate, sgl_grpc
from gateway_sim.envoy import envoy_binary, run_envoy
from gateway_sim.launch import Child, worker_url
from tests.support.extproc import headers_part, process
from tests.support.launch import Launcher
from tests.support.waits import until

WAIT_S = 20.0


def issue(ca: trustme.CA, directory: Path, stem: str, *names: str) -> None:
    cert = ca.issue_cert(*names)
    cert.private_key_pem.write_to_path(str(directory / f"{stem}.key"))
    for index, blob in enumerate(cert.cert_chain_pems):
        blob.write_to_path(str(directory / f"{stem}.pem"), append=index > 0)


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    """A CA, the gateway's certificate for 127.0.0.1, and Envoy's client certificate."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    issue(ca, tmp_path, "server", "127.0.0.1", "localhost")
    issue(ca, tmp_path, "envoy", "envoy.example")
    return tmp_path


def mtls_flags(pki: Path) -> tuple[str, ...]:
    return (
        "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
        "--tls-client-ca", str(pki / "ca.pem"),
    )  # fmt: skip


def picker_channel(pki: Path, address: str, client: str | None) -> aio.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=(pki / "ca.pem").read_bytes(),
        private_key=(pki / f"{client}.key").read_bytes() if client else None,
        certificate_chain=(pki / f"{client}.pem").read_bytes() if client else None,
    )
    return aio.secure_channel(address, credentials)


async def asks(ch: aio.Channel) -> grpc.StatusCode | str:
    """One Process stream's first answer (the part it answered), or its failure."""
    call = process(ch)()
    try:
        await call.write(headers_part(SGL + "HealthCheck"))
        answer = await call.read()
    except aio.AioRpcError as error:
        return error.code()
    finally:
        call.cancel()
    return str(answer.WhichOneof("response"))


async def test_the_picker_port_takes_the_main_ports_mtls(
    sim: Launcher, gateway: Launcher, pki: Path
) -> None:
    worker = sim("--model", "m")
    url = worker_url(worker, model="m", runtime="sglang")
    gw = gateway(*mtls_flags(pki), "--picker-listen", "0.0.0.0:0", "--worker", url)
    address = f"127.0.0.1:{gw.extra['picker'].rpartition(':')[2]}"
    async with channel(address) as plain:
        assert await asks(plain) is grpc.StatusCode.UNAVAILABLE
    async with picker_channel(pki, address, None) as no_certificate:
        assert await asks(no_certificate) is grpc.StatusCode.UNAVAILABLE
    async with picker_channel(pki, address, "envoy") as envoy:
        assert await asks(envoy) == "request_headers"  # the destination: the relay


async def test_envoy_reaches_the_picker_over_mtls_and_routes_a_call(
    sim: Launcher, gateway: Launcher, pki: Path, processes: list[Child], tmp_path: Path
) -> None:
    binary = envoy_binary()
    if binary is None:
        pytest.skip("no envoy binary")
    worker = sim("--model", "m")
    url = worker_url(worker, model="m", runtime="sglang")
    gw = gateway(*mtls_flags(pki), "--picker-listen", "0.0.0.0:0", "--worker", url)
    picker = f"127.0.0.1:{gw.extra['picker'].rpartition(':')[2]}"
    tls = PickerTls(
        str(pki / "ca.pem"), str(pki / "envoy.pem"), str(pki / "envoy.key"), sni="localhost"
    )
    bootstrap = envoy_config("127.0.0.1:0", picker, admin="127.0.0.1:0", picker_tls=tls)
    envoy = run_envoy(binary, bootstrap, tmp_path)
    processes.append(envoy)

    async def served() -> bool:
        async with channel(f"127.0.0.1:{envoy.port}") as ch:
            stub = sgl_grpc.SglangSchedulerStub(ch)
            messages, error = await collect(
                stub.Generate(sgl_generate("through-envoy"), metadata=model_md("m"), timeout=5)
            )
        return error is None and len(messages) == 5

    # Envoy health-checks the picker (over the same mTLS) before it sends it a call.
    await until(served, WAIT_S, what="a Generate through Envoy and the picker over mTLS")


def test_a_plaintext_picker_port_past_loopback_is_refused_at_start() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--picker-listen", "0.0.0.0:0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "picker.listen: '0.0.0.0:0' is not loopback" in line
    assert "picker.plaintext" in line
