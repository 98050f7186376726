"""`picker:`: the endpoint picker, placement for a proxy that relays the bytes itself."""

from __future__ import annotations

from pydantic.dataclasses import dataclass

from gateway.config.fields import SETTINGS, AtLeastOne, Flag, HeaderName, Text

DESTINATION_HEADER = "x-gateway-destination-endpoint"  # the Gateway API Inference Extension's


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
    its own buffer limit): the picker holds at most that much of a call."""

    listen: Text | None = None  # HOST:PORT, checked by build_config
    relay_address: Text | None = None  # HOST:PORT, checked by build_config
    header: HeaderName = DESTINATION_HEADER
    migrate_streams: Flag = False
    max_body_bytes: AtLeastOne = 1024 * 1024  # Envoy's own default buffer limit

    @property
    def enabled(self) -> bool:
        return self.listen is not None
