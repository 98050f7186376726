"""TLS on the main port (and mTLS), TLS to workers, API keys and the principal that scopes
Abort: real processes, generated stubs and grpcurl."""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import trustme
from grpc import aio

from gateway_sim.client import (
    SGL_SERVICE,
    channel,
    collect,
    model_md,
    sgl,
    sgl_generate,
    sgl_grpc,
    write_config,
)
from gateway_sim.launch import Child, worker_url
from tests.support.helpers import ABORT_COMPLETES, wait_for_events
from tests.support.launch import Launcher, grpcurl


@dataclass(frozen=True)
class Pki:
    directory: Path
    ca: trustme.CA

    def path(self, name: str) -> str:
        return str(self.directory / name)

    def read(self, name: str) -> bytes:
        return (self.directory / name).read_bytes()

    def issue(self, stem: str, *identities: str, common_name: str | None = None) -> None:
        cert = self.ca.issue_cert(*identities, common_name=common_name)
        cert.private_key_pem.write_to_path(self.path(f"{stem}.key"))
        for index, blob in enumerate(cert.cert_chain_pems):
            blob.write_to_path(self.path(f"{stem}.pem"), append=index > 0)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    """A CA, a server certificate for 127.0.0.1 and a client certificate for 'alice'."""
    made = Pki(tmp_path, trustme.CA())
    made.ca.cert_pem.write_to_path(made.path("ca.pem"))
    made.issue("server", "127.0.0.1", "localhost")
    made.issue("alice", "alice.example", common_name="alice")
    return made


def renew(pki: Pki) -> Pki:
    """A certificate from a new CA written over the server's files; the new CA's Pki."""
    renewed = Pki(pki.directory / "renewed", trustme.CA())
    renewed.directory.mkdir()
    renewed.ca.cert_pem.write_to_path(renewed.path("ca.pem"))
    renewed.issue("server", "127.0.0.1")
    Path(pki.path("server.pem")).write_bytes(renewed.read("server.pem"))
    Path(pki.path("server.key")).write_bytes(renewed.read("server.key"))
    return renewed


def secure(pki: Pki, address: str, client: str | None = None) -> aio.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki.read("ca.pem"),
        private_key=pki.read(f"{client}.key") if client else None,
        certificate_chain=pki.read(f"{client}.pem") if client else None,
    )
    return aio.secure_channel(address, credentials)


def tls_flags(pki: Pki) -> tuple[str, ...]:
    return ("--tls-cert", pki.path("server.pem"), "--tls-key", pki.path("server.key"))


async def generate_ok(ch: aio.Channel, request_id: str = "r1", *extra: tuple[str, str]) -> None:
    messages, error = await collect(
        sgl_grpc.SglangSchedulerStub(ch).Generate(
            sgl_generate(request_id), metadata=model_md("m", *extra)
        )
    )
    assert error is None and len(messages) == 5


async def test_tls_front_serves_stubs_and_grpcurl_and_refuses_plaintext(
    sim: Launcher, gateway: Launcher, pki: Pki
) -> None:
    worker = sim("--model", "m")
    gw = gateway(*tls_flags(pki), "--worker", worker_url(worker, model="m", runtime="sglang"))
    async with secure(pki, gw.address) as ch:
        await wait_until_servable(ch)
        await generate_ok(ch)
    listed = grpcurl("-cacert", pki.path("ca.pem"), gw.address, "list")
    assert listed.returncode == 0, listed.stderr
    assert SGL_SERVICE in listed.stdout.split()
    async with channel(gw.address) as plain:
        _, error = await collect(
            sgl_grpc.SglangSchedulerStub(plain).Generate(sgl_generate(), metadata=model_md("m"))
        )
    assert error is not None and error.code() is grpc.StatusCode.UNAVAILABLE


async def test_mtls_front_requires_a_client_certificate(
    sim: Launcher, gateway: Launcher, pki: Pki
) -> None:
    worker = sim("--model", "m")
    gw = gateway(
        *tls_flags(pki),
        "--tls-client-ca",
        pki.path("ca.pem"),
        "--worker",
        worker_url(worker, model="m", runtime="sglang"),
    )
    async with secure(pki, gw.address, client="alice") as ch:
        await wait_until_servable(ch)
        await generate_ok(ch)
    async with secure(pki, gw.address) as anonymous:
        _, error = await collect(
            sgl_grpc.SglangSchedulerStub(anonymous).Generate(sgl_generate(), metadata=model_md("m"))
        )
    assert error is not None and error.code() is grpc.StatusCode.UNAVAILABLE
    ca = pki.path("ca.pem")
    with_cert = grpcurl(
        "-cacert", ca, "-cert", pki.path("alice.pem"), "-key", pki.path("alice.key"),
        gw.address, "list",
    )  # fmt: skip
    assert with_cert.returncode == 0, with_cert.stderr
    # Refused in the handshake, which grpcurl retries until its connect timeout (10 s by
    # default, 3 s here): either way it never gets a connection.
    without = grpcurl("-cacert", ca, "-connect-timeout", "3", gw.address, "list")
    assert without.returncode != 0
    assert "Failed to dial target host" in without.stderr, without.stderr


async def test_certificates_reload_on_sighup_without_dropping_streams(
    sim: Launcher, gateway: Launcher, pki: Pki
) -> None:
    """A certificate from another CA replaces the files; after SIGHUP new connections get
    it, while a stream opened before keeps streaming to its end."""
    worker = sim("--model", "m", "--token-ms", "100")
    gw = gateway(*tls_flags(pki), "--worker", worker_url(worker, model="m", runtime="sglang"))
    async with secure(pki, gw.address) as old:
        await wait_until_servable(old)
        long = asyncio.ensure_future(
            collect(
                sgl_grpc.SglangSchedulerStub(old).Generate(
                    sgl_generate("long", 20), metadata=model_md("m")
                )
            )
        )
        await asyncio.sleep(0.3)  # the stream is under way on the old certificate
        renewed = renew(pki)
        gw.process.send_signal(signal.SIGHUP)
        async with secure(renewed, gw.address) as new:
            await generate_ok(new, "after-reload")
        messages, error = await long
    assert error is None and len(messages) == 21


async def test_tls_to_workers_with_mutual_authentication(
    sim: Launcher, gateway: Launcher, pki: Pki, tmp_path: Path
) -> None:
    pki.issue("worker", "127.0.0.1")
    pki.issue("gateway", "gateway.example", common_name="gateway")
    worker = sim(
        "--model", "m",
        "--tls-cert", pki.path("worker.pem"), "--tls-key", pki.path("worker.key"),
        "--tls-client-ca", pki.path("ca.pem"),
    )  # fmt: skip
    config = write_config(
        tmp_path,
        {
            "upstream_tls": {
                "ca": pki.path("ca.pem"),
                "cert": pki.path("gateway.pem"),
                "key": pki.path("gateway.key"),
            }
        },
    )
    url = f"grpcs://{worker.address}?model=m&runtime=sglang"
    gw = gateway("--config", config, "--worker", url)
    async with channel(gw.address) as ch:
        await wait_until_servable(ch)
        await generate_ok(ch)


async def wait_until_servable(ch: aio.Channel, *extra: tuple[str, str]) -> None:
    """Until the gateway's first probe found the worker ready (its engine HealthCheck)."""
    stub = sgl_grpc.SglangSchedulerStub(ch)
    for _ in range(100):  # bounded
        reply = await stub.HealthCheck(sgl.HealthCheckRequest(), metadata=model_md("m", *extra))
        if reply.healthy:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the grpcs:// worker never became servable")


KEYS = {"alice": "alice-key-0123456789", "bob": "bob-key-0123456789"}


def bearer(name: str) -> tuple[str, str]:
    return ("authorization", f"Bearer {KEYS[name]}")


@pytest.fixture
def keyed(sim: Launcher, gateway: Launcher, tmp_path: Path) -> tuple[Child, Child]:
    keys = tmp_path / "keys"
    keys.write_text("# name:key\n" + "".join(f"{n}:{k}\n" for n, k in KEYS.items()))
    config = write_config(tmp_path, {"auth": {"api_keys_file": str(keys)}})
    worker = sim("--model", "m", "--token-ms", "50")
    gw = gateway("--config", config, "--worker", worker_url(worker, model="m", runtime="sglang"))
    return worker, gw


async def test_api_keys_guard_the_main_port_but_not_health_or_reflection(
    keyed: tuple[Child, Child],
) -> None:
    _, gw = keyed
    async with channel(gw.address) as ch:
        await wait_until_servable(ch, bearer("alice"))
        stub = sgl_grpc.SglangSchedulerStub(ch)
        _, error = await collect(stub.Generate(sgl_generate(), metadata=model_md("m")))
        assert error is not None and error.code() is grpc.StatusCode.UNAUTHENTICATED
        assert (
            error.details() == "this gateway needs the metadata 'authorization: Bearer <API key>'"
        )
        wrong = ("authorization", "Bearer not-a-key-at-all")
        _, error = await collect(stub.Generate(sgl_generate(), metadata=model_md("m", wrong)))
        assert error is not None and error.code() is grpc.StatusCode.UNAUTHENTICATED
        assert error.details() == "the API key was not accepted"
        call = stub.Generate(sgl_generate(), metadata=model_md("m", bearer("alice")))
        messages, error = await collect(call)
        assert error is None and len(messages) == 5
        # The key is the gateway's business: it never reaches the worker.
        seen = dict(await call.initial_metadata())["x-sim-seen-metadata"]
        assert "authorization" not in seen.split(",")
    health = grpcurl("-plaintext", gw.address, "grpc.health.v1.Health/Check")
    assert health.returncode == 0 and '"status": "SERVING"' in health.stdout
    listed = grpcurl("-plaintext", gw.address, "list")
    assert listed.returncode == 0 and SGL_SERVICE in listed.stdout.split()


async def test_an_abort_from_another_principal_leaves_the_stream_alone(
    keyed: tuple[Child, Child],
) -> None:
    _, gw = keyed
    async with channel(gw.address) as ch:
        await wait_until_servable(ch, bearer("alice"))
        stub = sgl_grpc.SglangSchedulerStub(ch)
        victim = stub.Generate(sgl_generate("victim", 30), metadata=model_md("m", bearer("alice")))
        first = await victim.__aiter__().__anext__()
        assert first.HasField("chunk")

        async def abort(request_id: str, who: str) -> Any:
            return await stub.Abort(
                sgl.AbortRequest(request_id=request_id), metadata=model_md("m", bearer(who))
            )

        foreign, unknown = await abort("victim", "bob"), await abort("nobody", "bob")
        assert foreign.success is False and unknown.success is False
        assert foreign.message == "request 'victim' is not in flight here"
        assert unknown.message == "request 'nobody' is not in flight here"
        rest, error = await collect(victim)
        assert error is None and len(rest) == 30
        assert rest[-1].complete.finish_reason != "abort"
        # Its owner can abort it.
        mine = stub.Generate(
            sgl_generate("mine", 30), metadata=model_md("m", bearer("alice"), ABORT_COMPLETES)
        )
        await mine.__aiter__().__anext__()
        assert (await abort("mine", "alice")).success is True
        rest, error = await collect(mine)
        assert error is None and rest[-1].complete.finish_reason == "abort"
    events = wait_for_events(gw.log_path, 2, rpc="Abort")
    assert [e["targets"] for e in events[:2]] == [None, None]
