"""`picker:`: the endpoint picker, placement for a proxy that relays the bytes itself."""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import Annotated

from pydantic import AfterValidator, Field, Strict
from pydantic.dataclasses import dataclass

from gateway.config.fields import SETTINGS, Flag, HeaderName, Size, Text
from gateway.config.security import TlsConfig


def _network(text: str) -> str:
    """An address or a CIDR range (`10.0.0.0/8`, `::1`)."""
    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise ValueError(f"{text!r} is not an IP address or CIDR range") from None
    return text


Network = Annotated[str, Strict(), AfterValidator(_network)]

DESTINATION_HEADER = "x-gateway-destination-endpoint"  # the Gateway API Inference Extension's
MAX_BODY_BYTES = 1024 * 1024  # Envoy's own default buffer limit


@dataclass(frozen=True, slots=True, config=SETTINGS)
class PickerConfig:
    """Off unless `listen` is set. On `listen` the gateway serves Envoy's external
    processing protocol (`envoy.service.ext_proc.v3.ExternalProcessor/Process`): for each
    call Envoy relays, it places the call as the relay would and answers with the worker's
    `IP:PORT` in `header` (and in the `envoy.lb` dynamic metadata), or with the verdict
    the relay would give. Calls Envoy cannot run alone (a prefill-decode or encode pair,
    the other RPCs) are sent to the relay at `relay_address` (default: `listen` of the
    main port, a wildcard host read as 127.0.0.1); with `migrate_streams`, streamed
    Generates are too, so they can go on on another worker if theirs fails. A request
    body past `max_body_bytes` goes to the relay too (as does one Envoy cut short at
    its own buffer limit): the picker holds at most that much of a call. A call's client is
    the stream's own peer (Envoy) unless that peer is in `trusted_proxies`: then the
    address Envoy saw (`x-envoy-external-address`, else `x-forwarded-for` read from the
    right past the trusted hops). The port is Envoy's only: it serves TLS (`tls`, else the
    main port's `tls`, client CA included), and a `listen` past loopback without TLS is
    refused unless `plaintext` says the network encrypts the hop."""

    # HOST:PORT, checked by build_config
    listen: Text | None = Field(
        default=None,
        description="the endpoint picker's port (Envoy's ext_proc, `--picker-listen`); null: off",
    )
    # HOST:PORT, checked by build_config
    relay_address: Text | None = Field(
        default=None,
        description=(
            "`IP:PORT` Envoy sends the relay's calls to "
            "(`--picker-relay-address`); null: the main `listen` (a "
            "wildcard host as 127.0.0.1)"
        ),
    )
    header: HeaderName = Field(
        default=DESTINATION_HEADER,
        description="the request header the picker names each call's destination in",
    )
    migrate_streams: Flag = Field(
        default=False, description="streamed Generates go to the relay too, so they can migrate"
    )
    max_body_bytes: Size = Field(
        default=MAX_BODY_BYTES,
        description="the most of a request body the picker reads; a longer one goes to the relay",
    )
    # Peers whose forwarding headers are believed (else anyone reaching the port could
    # name any address: rotate past the failure block, or pose as another caller).
    trusted_proxies: Annotated[tuple[Network, ...], Field(max_length=256)] = Field(
        default=(),
        description=(
            "addresses or CIDR ranges (at most 256) whose forwarding "
            "headers name the client; none: the stream's own peer is"
        ),
    )
    # The port's own TLS; unset, the main port's `tls` (certificates and client CA).
    tls: TlsConfig = dataclasses.field(default_factory=TlsConfig)
    # Plaintext past loopback, on a network that encrypts the hop itself (a service
    # mesh's mTLS): else a non-loopback `listen` needs TLS.
    plaintext: Flag = Field(
        default=False,
        description=(
            "a `listen` past loopback without TLS, where the network "
            "encrypts the hop itself (a service mesh); else refused at "
            "start"
        ),
    )

    @property
    def enabled(self) -> bool:
        return self.listen is not None


def picker_tls(picker: PickerConfig, main: TlsConfig) -> TlsConfig:
    """The picker port's TLS: its own, else the main port's (never plaintext by accident
    where the main port is not)."""
    return picker.tls if picker.tls.enabled else main
