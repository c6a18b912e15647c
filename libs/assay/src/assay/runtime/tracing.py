"""OpenTelemetry traces, continued from the producer's `traceparent` (DESIGN §14).

Off unless the OpenTelemetry environment asks for an exporter
(`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, as the
OpenTelemetry conventions name them): then spans go to that OTLP/HTTP endpoint in
batches, named by `OTEL_SERVICE_NAME` or the stage. Off, the API's no-op tracer
still carries the parent's context, and every message's envelope continues the
trace of the message that caused it (`assay.messages.envelope.seal`).

Trace context travels in the envelope (and the Kafka `traceparent` header that
mirrors it), never in task-locals: each handled message opens a span whose
parent is the envelope's `traceparent`; what the handler emits carries that span.
A message nobody traced (a task produced without a `traceparent`, whose envelope
holds only the placeholder `seal` derives from its correlation id) has no span to
be the child of: its handling is the root of a new trace.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from assay.messages.envelope import Envelope, traceparent_for

_PROPAGATOR = TraceContextTextMapPropagator()
_tracer = trace.get_tracer("assay.runtime")

EXPORTER_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def configure(service: str) -> bool:
    """Export spans over OTLP/HTTP when the environment names an endpoint; True if it does.

    Call once per process, before the stages start.
    """
    if not any(os.environ.get(name) for name in EXPORTER_VARIABLES):
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = os.environ.get("OTEL_SERVICE_NAME") or service
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return True


def current_traceparent() -> str | None:
    """The W3C `traceparent` of the span being recorded now, if one is."""
    span = trace.get_current_span()
    if not span.is_recording():
        return None
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


@contextmanager
def handling(stage: str, env: Envelope, topic: str, partition: int) -> Iterator[Span]:
    """The span of one message's handling, a child of the span that produced it; the
    root of a new trace when no span produced it (`untraced`)."""
    parent = Context() if untraced(env) else _PROPAGATOR.extract({"traceparent": env.traceparent})
    attributes = {
        "assay.stage": stage,
        "assay.tenant": str(env.tenant),
        "messaging.system": "kafka",
        "messaging.destination.name": topic,
        "messaging.destination.partition.id": str(partition),
        "messaging.message.id": env.id,
    }
    with _tracer.start_as_current_span(
        f"{stage} {env.type}", context=parent, kind=SpanKind.CONSUMER, attributes=attributes
    ) as span:
        yield span


def untraced(env: Envelope) -> bool:
    """Whether `env` was produced outside any trace: it has no cause and its
    `traceparent` is the placeholder `seal` derives from its correlation id (its span
    id names no span anyone recorded)."""
    return env.causation_id is None and env.traceparent == traceparent_for(
        env.correlation_id, env.id
    )
