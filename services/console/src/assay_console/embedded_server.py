"""`assay serve-embedded`: the console of a long-running embedded process, and on the same
port what the process needs to be run without Kafka — `/metrics` (every stage's §15
signals), `/healthz`, `/readyz`, task intake and workflow registration.

Intake produces exactly what `assay submit` and `assay register` produce
(`assay.bus.commands`), for the tenant of the request's token, onto the process's
embedded bus.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from assay.bus import commands
from assay.bus.commands import CommandInvalid
from assay.bus.topics import WORKFLOWS
from assay.kernel.errors import AssayError
from assay.kernel.schema import one_line
from assay.messages import TaskSubmitted
from assay.runtime.embedded import Embedded
from assay.runtime.settings import AssaySettings
from assay.workflow import WorkflowInvalid, validate
from assay.workflow.formats import from_document
from assay_console.access import Access
from assay_console.actions import same_site
from assay_console.app import Problem, _tenant
from assay_console.outbox import EmbeddedOutbox
from assay_console.reads import ConsoleReads, SqliteRunsTable
from assay_console.runlog import DataDirRunLog
from assay_console.serving import RunningConsole, _serve
from assay_console.stages import ProcessStages

MAX_TASKS = 1000
"""The most tasks one intake request may carry."""
REGISTER_WAIT_S = 30.0
"""How long a registration waits for the stages to read it (then: 202)."""


class Registration(BaseModel):
    """A workflow to register: its definition, and the versions it derives from."""

    model_config = ConfigDict(extra="forbid")
    definition: dict[str, Any] = Field(description="The workflow (its JSON form).")
    parents: list[str] | None = Field(None, description="Versions it derives from.")
    rewrite: bool = Field(False, description="Replace the workflow's history.")


async def start_embedded(
    rt: Embedded, store: Path, settings: AssaySettings, host: str | None, port: int | None
) -> RunningConsole:
    """Serve the console over `rt` (which runs the console stage, its store the file
    `store`), with metrics, health and intake on the same port.

    Raises:
        AccessInvalid: no token is configured and `host` is not a loopback address.
        OSError: the address cannot be bound.
    """
    reads = ConsoleReads(rt.logs["console"], SqliteRunsTable(store))
    outbox = EmbeddedOutbox(rt.bus)
    routes = functools.partial(process_routes, rt)
    run_log = DataDirRunLog(store.parent)
    stages = ProcessStages.of(rt)
    return await _serve(reads, settings, host, port, outbox, routes, run_log, stages)


async def _json(request: Request, access: Access) -> Any:
    same_site(request, access)
    try:
        return json.loads(await request.body() or b"null")
    except json.JSONDecodeError as exc:
        raise Problem(400, f"body is not JSON: {exc.msg} at {exc.pos}") from exc


def _tasks(tenant: str, given: Any) -> list[TaskSubmitted]:
    """The tasks of an intake body: one object or a list of them, each completed with the
    request's tenant.

    Raises:
        Problem: 400 naming the task and what does not parse; 404 for another tenant.
    """
    items = given if isinstance(given, list) else [given]
    if not items or len(items) > MAX_TASKS:
        raise Problem(400, f"tasks: between 1 and {MAX_TASKS} per request")
    tasks = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise Problem(400, f"task {i}: expected an object")
        if item.get("tenant", tenant) != tenant:
            raise Problem(404, "no such tenant")
        try:
            tasks.append(TaskSubmitted.model_validate({**item, "tenant": tenant}))
        except ValidationError as exc:
            raise Problem(400, f"task {i}: {one_line(exc)}") from exc
    return tasks


async def until_read(rt: Embedded, topic: str, since: dict[int, int], seconds: float) -> bool:
    """Whether every stage that consumes `topic` read past what it held at `since` (plus
    what came since) within `seconds`: a task submitted after that finds the workflow."""
    ends = await rt.bus.end_offsets(topic)
    readers = [r for r in rt.runners.values() if topic in r.spec.topics]
    deadline = time.monotonic() + seconds
    while True:
        positions = [await r.log.positions() for r in readers]
        if all(read.get((topic, p), 0) >= ends[p] for read in positions for p in since):
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)  # the bus offers no wake-up for "a consumer caught up"


def process_routes(rt: Embedded, access: Access) -> Sequence[BaseRoute]:
    """`/metrics`, `/healthz`, `/readyz`, `POST /api/tasks` and `POST /api/workflows`."""
    registry, refresh = rt.metrics()

    async def metrics(request: Request) -> Response:
        await refresh()
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def healthz(request: Request) -> Response:
        status = rt.health()
        return JSONResponse(status, status_code=200 if status.get("ok") else 503)

    async def readyz(request: Request) -> Response:
        status = rt.health()
        return JSONResponse(status, status_code=200 if status.get("ready") else 503)

    async def tasks(request: Request) -> Response:
        tenant = _tenant(request, access)
        submitted = _tasks(str(tenant), await _json(request, access))
        await rt.bus.publish([commands.submit_task(t).entry for t in submitted])
        keys = [t.idempotency_key for t in submitted]
        return JSONResponse({"submitted": len(keys), "idempotency_keys": keys}, status_code=202)

    async def workflows(request: Request) -> Response:
        tenant = _tenant(request, access)
        try:
            given = Registration.model_validate(await _json(request, access))
            wf = validate(from_document(given.definition), frozenset(rt.deps.tools))
            cmd = commands.register_workflow(
                tenant,
                wf.model_dump(mode="json", by_alias=True),
                wf.version,
                rewrite=given.rewrite,
                parents=given.parents,
            )
        except ValidationError as exc:
            raise Problem(400, one_line(exc)) from exc
        except (WorkflowInvalid, CommandInvalid) as exc:
            raise Problem(400, str(exc)) from exc
        ends = await rt.bus.end_offsets(WORKFLOWS)
        await rt.bus.publish([cmd.entry])
        known = await until_read(rt, WORKFLOWS, ends, REGISTER_WAIT_S)
        answer = {"workflow_id": wf.id, "version": wf.version, "read": known}
        return JSONResponse(answer, status_code=200 if known else 202)

    return [
        Route("/metrics", metrics),
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/api/tasks", _guard(tasks), methods=["POST"]),
        Route("/api/workflows", _guard(workflows), methods=["POST"]),
    ]


def _guard(fn: Any) -> Any:
    async def endpoint(request: Request) -> Response:
        try:
            response: Response = await fn(request)
            return response
        except Problem as exc:
            return JSONResponse({"detail": exc.detail}, status_code=exc.status)
        except AssayError as exc:
            return JSONResponse({"detail": str(exc)}, status_code=400)

    return endpoint
