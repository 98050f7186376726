"""`limits:`: bounds on what one client can make the gateway do."""

from __future__ import annotations

from pydantic import Field
from pydantic.dataclasses import dataclass

from gateway.config.fields import SETTINGS, AtLeastOne, Interval, Seconds


@dataclass(frozen=True, slots=True, config=SETTINGS)
class LimitsConfig:
    """Bounds on what one client can make the gateway do.

    `max_choices`: the most `sampling_params.n` a Generate may ask for (a disaggregated
    request runs one prefill + decode pair per choice). `max_inflight_requests`: calls the
    gateway serves at once, over every protocol; over it, GATEWAY_OVERLOADED.
    `max_concurrent_streams`: per client connection (HTTP/2 SETTINGS; a client queues the
    rest). `stream_idle_timeout_s`: a stream on which no message moved either way for this
    long is ended. Connections with no call for `connection_idle_timeout_s` are closed;
    every connection is asked to go away after `max_connection_age_s` (so clients
    rebalance across replicas), its calls given `connection_age_grace_s` to finish.
    0 turns an idle timeout or the age limit off.

    `max_inflight_per_principal`: calls one principal (API key, client certificate, else
    peer address) may have in flight; None: a quarter of `max_inflight_requests`.
    `request_read_timeout_s`: from a stream's opening to its complete request message.
    `max_request_reads` / `max_request_reads_per_peer`: request messages read at once,
    over the gateway and per principal (a stream waits its turn, held back by HTTP/2 flow
    control meanwhile), so partially sent messages hold at most that many times
    `max_message_bytes`. `max_connections`: client connections at once (grpc core closes
    the ones past it); `max_connections_per_peer`: one client address's share of them (the
    newest past it are closed within a few seconds). `max_prompt_tokens`: prompt length a
    Generate may carry. `max_completion_tokens`: what one choice of a Generate that sets
    no max new tokens is believed to generate; a worker's usage past what a call could
    have generated (its choices times its max new tokens, else this) is not believed."""

    max_choices: AtLeastOne = Field(
        default=16, description="most `sampling_params.n`; past it: REQUEST_OVER_LIMIT"
    )
    max_inflight_requests: AtLeastOne = Field(
        default=4096, description="calls in flight at once; past it: GATEWAY_OVERLOADED"
    )
    max_concurrent_streams: AtLeastOne = Field(
        default=256, description="streams per client connection (HTTP/2 SETTINGS)"
    )
    stream_idle_timeout_s: Seconds = Field(
        default=300.0, description="a stream on which nothing moved this long is ended; 0: off"
    )
    connection_idle_timeout_s: Seconds = Field(
        default=300.0, description="a connection with no call this long is closed; 0: off"
    )
    max_connection_age_s: Seconds = Field(
        default=3600.0, description="every connection is asked to go away after this; 0: off"
    )
    connection_age_grace_s: Seconds = Field(
        default=600.0, description="then its calls get this long to finish"
    )
    max_inflight_per_principal: AtLeastOne | None = Field(
        default=None,
        description=(
            "one caller's calls in flight (null: a quarter of "
            "`max_inflight_requests`); past it: CALLER_OVER_SHARE"
        ),
    )
    request_read_timeout_s: Interval = Field(
        default=30.0, description="from a stream's opening to its complete request"
    )
    max_request_reads: AtLeastOne = Field(
        default=32, description="request messages read at once; the rest wait their turn"
    )
    max_request_reads_per_peer: AtLeastOne = Field(
        default=2, description="request messages one caller has read at once"
    )
    max_connections: AtLeastOne = Field(
        default=10_000,
        description="client connections at once; grpc core closes the ones past it",
    )
    max_connections_per_peer: AtLeastOne = Field(
        default=1_000,
        description="one client address's connections; the newest past it are closed",
    )
    max_prompt_tokens: AtLeastOne = Field(
        default=1_000_000, description="longest `tokenized.input_ids`; past it: REQUEST_OVER_LIMIT"
    )
    max_completion_tokens: AtLeastOne = Field(
        default=131_072,
        description="what a choice with no max new tokens is believed to generate at most",
    )

    @property
    def principal_share(self) -> int:
        """The calls one principal may hold: configured, else a quarter of the total."""
        if self.max_inflight_per_principal is not None:
            return self.max_inflight_per_principal
        return max(1, self.max_inflight_requests // 4)
