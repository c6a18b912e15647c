"""Traces in distributed mode: a task produced to Kafka with a W3C `traceparent` header
is one trace across the stage processes, each exporting its spans over OTLP/HTTP (the
standard `OTEL_EXPORTER_OTLP_ENDPOINT`) to a collector this test starts; the result's
Kafka header carries the producer's trace id, and a task produced without one starts a
new trace at ingest (DESIGN §14)."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from assay.bus import RESULTS
from assay.devstack import Service
from assay.devstack.deployment import Deployment, deploy
from tests.pipeline import DISTRIBUTED, TASKS, read_topic, set_up_tenant, wait_for

pytestmark = [*DISTRIBUTED, pytest.mark.timeout(420)]

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PRODUCER_SPAN = "b7ad6b7169203331"
PRODUCER = f"00-{TRACE_ID}-{PRODUCER_SPAN}-01"
TRACED = TASKS[200:208]
"""Tasks produced in the producer's trace: enough that at least one shadow run passes
beside its reference, so the judge (not the verifier) compares them (a task's runs
both pass about three times in five)."""
UNTRACED = TASKS[208]


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent: str
    """The parent's span id; "" for the root of a trace."""


class Collector:
    """An OTLP/HTTP trace receiver on loopback that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        collector = self

        class Receive(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                collector.received(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Receive)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def received(self, request: ExportTraceServiceRequest) -> None:
        found = []
        for resource in request.resource_spans:
            service = next(
                (
                    a.value.string_value
                    for a in resource.resource.attributes
                    if a.key == "service.name"
                ),
                "",
            )
            for scope in resource.scope_spans:
                found += [
                    Span(
                        service,
                        s.name,
                        s.trace_id.hex(),
                        s.span_id.hex(),
                        s.parent_span_id.hex(),
                    )
                    for s in scope.spans
                ]
        with self._lock:
            self.spans += found

    def in_trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    c = Collector()
    c.thread.start()
    try:
        yield c
    finally:
        c.server.shutdown()
        c.server.server_close()


@pytest.fixture(scope="module")
def deployment(
    postgres: Service, s3: Service, collector: Collector, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    otlp = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    d = asyncio.run(deploy(tmp_path_factory.mktemp("traces"), postgres, s3, extra_env=otlp))
    try:
        yield d
    finally:
        d.stop()


async def produce(
    bootstrap: str, tenant: str, task: dict[str, Any], traceparent: str | None
) -> None:
    """A bare `TaskSubmitted`, as a user's producer writes it, with its trace header."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        body = json.dumps({"tenant": tenant, "workflow_id": "arith", **task}).encode()
        headers = [("traceparent", traceparent.encode())] if traceparent else []
        key = f"{tenant}:{task['idempotency_key']}".encode()
        await producer.send_and_wait("assay.tasks", body, key=key, headers=headers)
    finally:
        await producer.stop()


def result_traces(records: list[Any], tenant: str) -> dict[str, str]:
    """Each of `tenant`'s results on assay.results: idempotency key -> the trace id its
    Kafka `traceparent` header carries."""
    found = {}
    for r in records:
        env = json.loads(r.value)
        if env.get("type") != "RunResult" or env["tenant"] != tenant:
            continue
        header = dict(r.headers)["traceparent"].decode()
        found[env["payload"]["idempotency_key"]] = header.split("-")[1]
    return found


async def test_a_producers_trace_spans_every_stage_process_and_reaches_the_result(
    deployment: Deployment, collector: Collector, tmp_path: Path
) -> None:
    d = deployment
    tenant = await set_up_tenant(d, challenger=True)  # shadow runs: the judge compares
    for task in TRACED:
        await produce(d.bootstrap, tenant, task, PRODUCER)
    await produce(d.bootstrap, tenant, UNTRACED, None)
    keys = {t["idempotency_key"] for t in [*TRACED, UNTRACED]}

    def every_result(records: list[Any]) -> bool:
        return set(result_traces(records, tenant)) >= keys

    traces = result_traces(await read_topic(d.bootstrap, RESULTS, every_result, 180), tenant)
    assert set(traces) >= keys, "every task has its result"
    assert {traces[t["idempotency_key"]] for t in TRACED} == {TRACE_ID}, "the producer's trace"
    expected = {
        ("assay-ingest", "ingest TaskSubmitted"),
        ("assay-execute", "execute RunSpawned"),
        ("assay-execute", "attempt solve"),
        ("assay-execute", "model solve"),
        ("assay-execute", "tool extract_number"),
        ("assay-verify", "verify RunExecuted"),
        ("assay-tournament", "tournament RunVerified"),
        ("assay-tournament", "judge compare"),
    }

    async def every_stage() -> bool:
        return expected <= {(s.service, s.name) for s in collector.in_trace(TRACE_ID)}

    await wait_for("every stage's spans in the producer's trace", every_stage, 120)
    ingest = [s for s in collector.in_trace(TRACE_ID) if s.name == "ingest TaskSubmitted"]
    assert {s.parent for s in ingest} == {PRODUCER_SPAN}, "children of the producer's span"
    # The task produced without a trace: a new one, rooted at ingest, carried to its result.
    new_trace = traces[UNTRACED["idempotency_key"]]
    assert new_trace != TRACE_ID

    async def rooted() -> bool:
        names = {s.name for s in collector.in_trace(new_trace)}
        return {"ingest TaskSubmitted", "execute RunSpawned", "verify RunExecuted"} <= names

    await wait_for("the untraced task's spans", rooted, 60)
    (root,) = [s for s in collector.in_trace(new_trace) if s.name == "ingest TaskSubmitted"]
    assert root.parent == "", "a new trace starts at ingest"
