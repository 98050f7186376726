"""OpenTelemetry traces: one SERVER span per call, a placement span per placement (and
the wait in a flow-control queue), one CLIENT span per upstream attempt and leg, whose
`traceparent` goes to the worker so an engine that traces joins the trace.

Off unless an OTLP endpoint is configured (`tracing.endpoint`, or the standard
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`); then every hook
in the proxy is one `is None` check. Spans end on the event loop into the SDK's batch
processor (a bounded queue); a thread of its own exports them over OTLP/gRPC, so a slow
or absent collector never blocks a call: what does not fit, or fails to export, is
dropped and counted (`gateway_trace_spans_dropped_total`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import grpc
import structlog
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span as Span  # re-exported: the proxy names a leg's span
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.config import TracingConfig
from gateway.core.roles import Role
from gateway.core.verdicts import Verdict
from gateway.observability.record import CallRecord

log = structlog.get_logger("gateway.observability.tracing")

# The trace context keys a client sends: with tracing on, the gateway continues the
# trace and sends its own to the workers (the client's are not forwarded as they are).
TRACE_KEYS = frozenset({"traceparent", "tracestate"})
MAX_ATTRIBUTE_CHARS = 256
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_PROPAGATOR = TraceContextTextMapPropagator()


def enabled(settings: TracingConfig, environ: Mapping[str, str] = os.environ) -> bool:
    """Tracing is on when an endpoint is configured, here or the standard way."""
    if environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    return settings.endpoint is not None or any(environ.get(v) for v in ENDPOINT_VARIABLES)


class CountingExporter(SpanExporter):
    """The OTLP exporter, counting what it was handed and what it failed to deliver; it
    says once when exports start failing and once when they work again."""

    def __init__(self, inner: SpanExporter) -> None:
        self._inner = inner
        self.handed = 0  # spans taken out of the queue (written by the export thread)
        self.exported = 0
        self.failed = 0
        self._failing = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.handed += len(spans)
        try:
            result = self._inner.export(spans)
        except Exception:  # an exporter bug must not end the export thread
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self.exported += len(spans)
            if self._failing:
                self._failing = False
                log.info("trace export recovered")
        else:
            self.failed += len(spans)
            if not self._failing:
                self._failing = True
                log.warning("trace export failing: spans are dropped until it recovers")
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class CountingProcessor(BatchSpanProcessor):
    """The SDK's batch processor, counting the spans it drops when its queue is full (the
    queue holds what was ended and not yet handed to the exporter)."""

    def __init__(self, exporter: CountingExporter, max_queue: int, **settings: Any) -> None:
        super().__init__(exporter, max_queue_size=max_queue, **settings)
        self._exporter = exporter
        self._max_queue = max_queue
        self.ended = 0
        self.overflowed = 0

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is None or not span.context.trace_flags.sampled:
            return
        waiting = self.ended - self._exporter.handed - self.overflowed
        if waiting >= self._max_queue:
            self.overflowed += 1  # the oldest queued span falls out to make room
        self.ended += 1
        super().on_end(span)


class Tracing:
    """The gateway's tracer: spans for calls (`start`), and how many went where."""

    def __init__(self, settings: TracingConfig, *, process: str = "") -> None:
        attributes: dict[str, Any] = {}
        if settings.service_name is not None:
            attributes[SERVICE_NAME] = settings.service_name
        elif not os.environ.get("OTEL_SERVICE_NAME"):
            attributes[SERVICE_NAME] = "model-gateway"
        attributes["process.pid"] = os.getpid()
        if process:  # one of --processes N
            attributes["gateway.process"] = process
        sampler = (
            ParentBased(TraceIdRatioBased(settings.sample_ratio))
            if settings.sample_ratio is not None
            else None  # the SDK reads OTEL_TRACES_SAMPLER(_ARG); parent-based always-on
        )
        # Clients name request ids, models and tenants: what a span keeps of any value is
        # bounded, so a queue of spans stays small whatever they send.
        limits = SpanLimits(max_attribute_length=MAX_ATTRIBUTE_CHARS)
        self.provider = TracerProvider(
            resource=Resource.create(attributes), sampler=sampler, span_limits=limits
        )
        # The SDK logs each dropped span and failed export; they are counted instead.
        logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)
        self.exporter = CountingExporter(
            OTLPSpanExporter(
                endpoint=settings.endpoint,
                insecure=settings.insecure,
                timeout=settings.export_timeout_s,
            )
        )
        self.processor = CountingProcessor(
            self.exporter,
            settings.max_queue,
            schedule_delay_millis=settings.schedule_delay_ms,
            max_export_batch_size=min(settings.batch_size, settings.max_queue),
        )
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("model-gateway")

    def start(
        self,
        record: CallRecord,
        metadata: Sequence[tuple[str, str | bytes]] | None,
        peer: str,
    ) -> CallTrace:
        """A SERVER span for a call that just opened, continuing the client's trace."""
        carrier = {k: v for k, v in metadata or () if k in TRACE_KEYS and isinstance(v, str)}
        parent = _PROPAGATOR.extract(carrier) if carrier else None
        service, method = record.service, record.rpc
        span = self.tracer.start_span(
            f"{service}/{method}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "rpc.system": "grpc",
                "rpc.service": service,
                "rpc.method": method,
                "network.peer.address": peer,
            },
        )
        record.trace_id = trace.format_trace_id(span.get_span_context().trace_id)
        return CallTrace(self.tracer, span, record)

    def counts(self) -> tuple[int, int]:
        """(spans exported, spans dropped: a full queue or a failed export)."""
        exporter = self.exporter
        return exporter.exported, exporter.failed + self.processor.overflowed

    def close(self, timeout_s: float = 2.0) -> None:
        """Export what is queued, for at most `timeout_s` (a collector that is down does
        not hold up the gateway's exit)."""
        done = threading.Thread(target=self.provider.shutdown, daemon=True)
        done.start()
        done.join(timeout_s)


class Named(Protocol):
    @property
    def id(self) -> str: ...


class Placed(Protocol):
    """What a span tells of a placement (`placement.decision.Decision`)."""

    @property
    def policy(self) -> str: ...

    @property
    def candidates(self) -> int: ...

    @property
    def expected_cached_tokens(self) -> int | None: ...

    def all(self) -> Sequence[Named]: ...


class Address(Protocol):
    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...


class Upstream(Protocol):
    """What a span tells of the worker an upstream call goes to (`upstream.worker.Worker`)."""

    @property
    def id(self) -> str: ...

    @property
    def spec(self) -> Address: ...


class CallTrace:
    """The spans of one call. The front starts it and finishes it from the record; the
    dispatch adds placements and upstream legs."""

    __slots__ = ("_context", "_record", "_tracer", "span")

    def __init__(self, tracer: trace.Tracer, span: Span, record: CallRecord) -> None:
        self._tracer = tracer
        self.span = span
        self._context = trace.set_span_in_context(span)
        self._record = record  # its attempts so far number each leg's attempt

    def placement(
        self,
        started_ns: int,
        placed: Placed | Verdict,
        tried: Sequence[str] = (),
        queued_s: float | None = None,
    ) -> None:
        """A placement that began at `started_ns` and ended now (`queued_s`: made by a
        flow-control waiting room, the wait included)."""
        attributes: dict[str, Any] = {"gateway.excluded_workers": list(tried)}
        if queued_s is not None:
            attributes["gateway.queue_wait_s"] = queued_s
        if isinstance(placed, Verdict):
            attributes["gateway.verdict"] = placed.reason.name
        else:
            attributes.update(
                {
                    "gateway.policy": placed.policy,
                    "gateway.candidates": placed.candidates,
                    "gateway.workers": [w.id for w in placed.all()],
                }
            )
            if placed.expected_cached_tokens is not None:
                attributes["gateway.expected_cached_tokens"] = placed.expected_cached_tokens
        span = self._tracer.start_span(
            "placement", context=self._context, start_time=started_ns, attributes=attributes
        )
        span.end()

    def leg(
        self, worker: Upstream, leg: Role, rank: int | None
    ) -> tuple[Span, tuple[tuple[str, str], ...]]:
        """A CLIENT span for one upstream RPC, and the metadata that carries it."""
        attempt = self._record.attempts
        attributes: dict[str, Any] = {
            "rpc.system": "grpc",
            "server.address": worker.spec.host,
            "server.port": worker.spec.port,
            "gateway.worker": worker.id,
            "gateway.leg": leg.value,
            "gateway.attempt": attempt,
            "gateway.retry": attempt > 1,
        }
        if rank is not None:
            attributes["gateway.data_parallel_rank"] = rank
        span = self._tracer.start_span(
            f"upstream {leg.value}", context=self._context, kind=SpanKind.CLIENT,
            attributes=attributes,
        )  # fmt: skip
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        return span, tuple(carrier.items())

    def migration(self, worker: str, cause: str, outcome: str, relayed: int) -> None:
        """A stream's worker failed after `relayed` tokens reached the client: whether it
        went on elsewhere (an event on the call's span)."""
        self.span.add_event(
            "migration",
            {
                "gateway.worker": worker,
                "gateway.migration.cause": cause,
                "gateway.migration.outcome": outcome,
                "gateway.migration.relayed_tokens": relayed,
            },
        )

    def finish(self, record: CallRecord) -> None:
        """The call ended: what it did, from its record."""
        span = self.span
        if not span.is_recording():
            span.end()
            return
        attributes: dict[str, Any] = {
            "rpc.grpc.status_code": _STATUS_NUMBERS.get(record.code, 2),
            "gateway.attempts": record.attempts,
            "gateway.retries": record.retries,
        }
        operation = _OPERATIONS.get(record.rpc)
        if operation is not None:
            attributes["gen_ai.operation.name"] = operation
            attributes["gen_ai.usage.input_tokens"] = record.prompt_tokens
        optional = {
            "gen_ai.request.model": record.model or None,
            "gen_ai.response.id": record.request_id or None,
            "gen_ai.usage.output_tokens": record.completion_tokens,
            "gen_ai.usage.cache_read.input_tokens": record.cached_tokens,
            "gen_ai.response.time_to_first_chunk": record.first_message_s,
            "gateway.expected_cached_tokens": record.expected_cached_tokens,
            "gateway.worker": record.worker,
            "gateway.reason": record.verdict.reason.name if record.verdict else None,
            "gateway.stage": record.stage if record.code != "OK" else None,
            "gateway.principal": record.principal,
            "gateway.tenant": record.tenant,
            "gateway.class": record.priority,
            "gateway.queue_wait_s": record.queued_s,
        }
        attributes.update({k: v for k, v in optional.items() if v is not None})
        span.set_attributes(attributes)
        if record.code != "OK":
            span.set_status(Status(StatusCode.ERROR, record.code))
        span.end()


def end_leg(span: Span, code: str | None) -> None:
    """An upstream RPC ended with `code` (None: cancelled before it ended)."""
    outcome = code or "CANCELLED"
    span.set_attribute("gateway.outcome", outcome)
    span.set_attribute("rpc.grpc.status_code", _STATUS_NUMBERS.get(outcome, 2))
    if outcome != "OK":
        span.set_status(Status(StatusCode.ERROR, outcome))
    span.end()


_OPERATIONS = {"Generate": "text_completion", "Embed": "embeddings"}
_STATUS_NUMBERS = {code.name: code.value[0] for code in grpc.StatusCode}
