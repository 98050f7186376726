"""`limits:`: bounds on what one client can make the gateway do."""

from __future__ import annotations

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

    max_choices: AtLeastOne = 16
    max_inflight_requests: AtLeastOne = 4096
    max_concurrent_streams: AtLeastOne = 256
    stream_idle_timeout_s: Seconds = 300.0
    connection_idle_timeout_s: Seconds = 300.0
    max_connection_age_s: Seconds = 3600.0
    connection_age_grace_s: Seconds = 600.0
    max_inflight_per_principal: AtLeastOne | None = None
    request_read_timeout_s: Interval = 30.0
    max_request_reads: AtLeastOne = 32
    max_request_reads_per_peer: AtLeastOne = 2
    max_connections: AtLeastOne = 10_000
    max_connections_per_peer: AtLeastOne = 1_000
    max_prompt_tokens: AtLeastOne = 1_000_000
    max_completion_tokens: AtLeastOne = 131_072

    @property
    def principal_share(self) -> int:
        """The calls one principal may hold: configured, else a quarter of the total."""
        if self.max_inflight_per_principal is not None:
            return self.max_inflight_per_principal
        return max(1, self.max_inflight_requests // 4)
