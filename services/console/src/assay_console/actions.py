"""The console's actions: approve or signal a waiting run, cancel a run or a rollout
group, rewind a run, approve or reject a proposal, delete a tenant (`tenants`).

Each produces the command the CLI produces (`assay.bus.commands`) for the request's
tenant, and answers with its outcome: 200 once the run shows the command's effect,
409 with the owning stage's reason when it refused it, or 202 with where to look when
neither happened within `?wait=` seconds (default 10, at most 30; 0 does not wait).

Against cross-site request forgery an action accepts only a JSON body (a cross-site
form cannot send one without a preflight the console never grants) and refuses a
request whose `Origin` or `Sec-Fetch-Site` says it came from another site, which also
covers an open console on loopback. A request that a login cookie (not a bearer token)
authenticates must also carry the session's CSRF token (`sessions.py`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from importlib.resources import files
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from assay.bus import commands
from assay.bus.commands import Command, CommandInvalid
from assay.kernel import RunState
from assay.kernel.ids import TenantId
from assay.kernel.schema import one_line
from assay_console.access import Access
from assay_console.app import (
    NO_PROPOSAL,
    NOT_FOUND,
    Endpoint,
    Problem,
    _run_id,
    _tenant,
    caller,
)
from assay_console.outbox import Outbox
from assay_console.reads import MAX_LIMIT, ConsoleReads, RunDetail, RunFilters, RunSummary
from assay_console.sessions import CSRF_HEADER
from assay_console.workflow_views import ProposalView
from assay_console.workflows import proposal_view

DEFAULT_WAIT_S = 10.0
MAX_WAIT_S = 30.0
POLL_S = 0.1


class ApproveBody(BaseModel):
    """Approve a run waiting at an await step for a human approval."""

    model_config = ConfigDict(extra="forbid")
    payload: str = Field("approved", max_length=100_000, description="The await step's output.")


class SignalBody(BaseModel):
    """Send a named signal to a waiting run."""

    model_config = ConfigDict(extra="forbid")
    signal: str = Field(description="The signal's name (`approval` approves).")
    payload: str = Field("", max_length=100_000, description="The await step's output.")


class CancelBody(BaseModel):
    """Stop a run, or a rollout group."""

    model_config = ConfigDict(extra="forbid")
    reason: str = Field("", max_length=2000, description="Why, for people.")


class RewindBody(BaseModel):
    """Fork a run at an LSN of one of its branches and drive the new branch."""

    model_config = ConfigDict(extra="forbid")
    at: int = Field(ge=0, description="The LSN to fork at.")
    branch: int | None = Field(None, ge=0, description="The branch (default: the main one).")
    reason: str = Field("", max_length=2000, description="Why, for people.")


class ReviewBody(BaseModel):
    """An operator's verdict on a proposal."""

    model_config = ConfigDict(extra="forbid")
    workflow_id: str = Field(description="The proposal's workflow.")
    reason: str = Field("", max_length=2000, description="Why, for the record.")


class ActionOutcome(BaseModel):
    """What came of an action."""

    outcome: Literal["applied", "pending"] = Field(
        description="`applied`: its effect was seen; `pending`: not yet (poll `poll`)."
    )
    command: str = Field(description="The command's message id.")
    poll: str = Field(description="Where to look for its effect.")
    run: RunSummary | None = Field(None, description="The run as it is now (run actions).")
    proposal: ProposalView | None = Field(None, description="The proposal as it is now (reviews).")


BODIES: dict[str, type[BaseModel]] = {
    "approve": ApproveBody,
    "signal": SignalBody,
    "cancel": CancelBody,
    "rewind": RewindBody,
}


def same_site(request: Request, access: Access) -> None:
    """Refuse a state change that is not a same-site JSON request, or that a login
    cookie authenticates without the session's CSRF token.

    Raises:
        Problem: 415 without a JSON body; 403 from another origin or without the
            CSRF token; 401 when nobody is identified.
    """
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise Problem(415, "an action takes a JSON body (content-type: application/json)")
    same_origin(request)
    session = caller(request, access).session
    given = request.headers.get(CSRF_HEADER)
    if session is not None and not access.sessions.csrf_matches(session, given):
        raise Problem(403, f"a login session's action needs its CSRF token ({CSRF_HEADER})")


def same_origin(request: Request) -> None:
    """Refuse a request another site's page sent.

    Raises:
        Problem: 403 when `Sec-Fetch-Site` or `Origin` name another site.
    """
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        raise Problem(403, "cross-site request refused")
    origin = request.headers.get("origin")
    if origin is not None and urlsplit(origin).netloc != request.headers.get("host"):
        raise Problem(403, f"cross-origin request refused ({origin!r})")


async def body(request: Request, model: type[BaseModel]) -> Any:
    """The request's JSON body as `model`.

    Raises:
        Problem: 400 naming what does not parse.
    """
    raw = await request.body()
    try:
        return model.model_validate(json.loads(raw or b"{}"))
    except json.JSONDecodeError as exc:
        raise Problem(400, f"body is not JSON: {exc.msg} at {exc.pos}") from exc
    except ValidationError as exc:
        raise Problem(400, one_line(exc)) from exc


def wait_s(request: Request) -> float:
    """`?wait=` seconds, capped.

    Raises:
        Problem: 400 when it is not a number of seconds.
    """
    raw = request.query_params.get("wait")
    if raw is None:
        return DEFAULT_WAIT_S
    try:
        seconds = float(raw)
    except ValueError as exc:
        raise Problem(400, f"wait: {raw!r} is not a number of seconds") from exc
    if not 0 <= seconds <= MAX_WAIT_S:
        raise Problem(400, f"wait: between 0 and {MAX_WAIT_S:g} seconds")
    return seconds


def _extra(request: Request) -> None:
    extra = sorted(set(request.query_params) - {"tenant", "wait"})
    if extra:
        raise Problem(400, f"unknown parameter: {', '.join(extra)}")


def run_command(tenant: TenantId, run: RunDetail, verb: str, given: Any) -> Command:
    """The command `verb` asks of `run`, if its state allows it.

    Raises:
        Problem: 409 when the run is not in a state the command applies to.
    """
    state = run.run.state
    if verb in ("approve", "signal") and state != RunState.SUSPENDED.value:
        raise Problem(409, f"run {run.run.run_id} is not waiting (state: {state})")
    if verb == "cancel" and state is not None and not RunState(state).cancellable:
        raise Problem(409, f"run {run.run.run_id} has ended (state: {state})")
    run_id = run.run.run_id
    match given:
        case ApproveBody(payload=payload):
            return commands.signal_run(tenant, run_id, commands.APPROVAL, payload)
        case SignalBody(signal=name, payload=payload):
            return commands.signal_run(tenant, run_id, name, payload)
        case CancelBody(reason=reason):
            return commands.cancel_run(tenant, run_id, reason)
        case RewindBody(at=at, branch=branch, reason=reason):
            return commands.rewind_run(tenant, run_id, at, branch, reason)
    raise Problem(404, f"no action {verb!r}")


async def settle(
    outbox: Outbox, command: Command, seen: Callable[[], Awaitable[bool]], seconds: float
) -> bool:
    """Send `command`; whether its effect was `seen` within `seconds`.

    Raises:
        Problem: 409 with the reason its stage refused it.
    """
    sent = await outbox.send(command)
    deadline = time.monotonic() + seconds
    try:
        while True:
            if await seen():
                return True
            if (reason := await sent.refused()) is not None:
                raise Problem(409, f"refused: {reason}")
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(POLL_S)  # the read model folds from the topics: look again
    finally:
        await sent.close()


def command_id(command: Command) -> str:
    """The message id the command carries."""
    from assay.messages.envelope import open_envelope

    return open_envelope(command.entry.value).id


def action_routes(
    reads: ConsoleReads,
    access: Access,
    outbox: Outbox | None,
    guarded: Callable[[Callable[[Request], Awaitable[Response]]], Endpoint],
) -> list[Route]:
    """The action endpoints, answering 503 when the console has nowhere to publish."""

    def publishing() -> Outbox:
        if outbox is None:
            raise Problem(503, "this console cannot publish commands (read-only)")
        return outbox

    async def run_action(request: Request) -> Response:
        same_site(request, access)
        _extra(request)
        verb = str(request.path_params["verb"])
        model = BODIES.get(verb)
        if model is None:
            raise Problem(404, f"no action {verb!r}")
        run_id, tenant = _run_id(request), _tenant(request, access)
        given = await body(request, model)
        before = await reads.run(tenant, run_id)
        if before is None:
            raise Problem(404, NOT_FOUND)
        try:
            command = run_command(tenant, before, verb, given)
        except CommandInvalid as exc:
            raise Problem(400, str(exc)) from exc

        async def seen() -> bool:
            now = await reads.run(tenant, run_id)
            assert now is not None  # a run the console knows stays known
            if verb == "cancel":
                return now.run.state == RunState.CANCELLED.value or (
                    now.run.state is not None and not RunState(now.run.state).cancellable
                )
            return len(now.timeline) > len(before.timeline)

        done = await settle(publishing(), command, seen, wait_s(request))
        after = await reads.run(tenant, run_id)
        return _answer(request, command, done, f"/api/runs/{run_id}", after)

    async def rollout_cancel(request: Request) -> Response:
        same_site(request, access)
        _extra(request)
        tenant = _tenant(request, access)
        group = str(request.path_params["group"])
        given = await body(request, CancelBody)
        page = await reads.runs(tenant, RunFilters(key=group[:500]), None, MAX_LIMIT)
        if not any(r.idempotency_key == group for r in page.runs):  # siblings share the key
            raise Problem(404, "no such rollout group")
        try:
            command = commands.cancel_rollout(tenant, group, given.reason)
        except CommandInvalid as exc:
            raise Problem(400, str(exc)) from exc

        async def stopped() -> bool:
            """Every sibling ended: cancelled, or past the point a cancel could reach."""
            now = await reads.runs(tenant, RunFilters(key=group[:500]), None, MAX_LIMIT)
            states = [r.state for r in now.runs if r.idempotency_key == group]
            return all(s is not None and not RunState(s).cancellable for s in states)

        done = await settle(publishing(), command, stopped, wait_s(request))
        return _answer(request, command, done, f"/api/runs?key={group}", None)

    async def review(request: Request) -> Response:
        same_site(request, access)
        _extra(request)
        tenant = _tenant(request, access)
        proposal, verb = str(request.path_params["proposal"]), str(request.path_params["verb"])
        if verb not in ("approve", "reject"):
            raise Problem(404, f"no action {verb!r}")
        given = await body(request, ReviewBody)
        try:
            command = commands.review_proposal(
                tenant, given.workflow_id, proposal, verb == "approve", given.reason
            )
        except CommandInvalid as exc:
            raise Problem(400, str(exc)) from exc
        row = await reads.proposal(tenant, proposal)
        if row is None or row.workflow_id != given.workflow_id:
            raise Problem(404, NO_PROPOSAL)  # the console's own record, in either mode
        if not row.open:
            status = proposal_view(row).status
            raise Problem(409, f"proposal {proposal} is not waiting for review ({status})")

        async def reviewed() -> bool:
            now = await reads.proposal(tenant, proposal)
            return now is not None and now.approve is not None

        done = await settle(publishing(), command, reviewed, wait_s(request))
        after = await reads.proposal(tenant, proposal)
        view = proposal_view(after) if after is not None else None
        return _answer(request, command, done, f"/api/proposals/{proposal}", None, view)

    async def script(request: Request) -> Response:
        name = "proposals.js" if request.url.path.endswith("proposals.js") else "actions.js"
        text = files("assay_console").joinpath("static", name).read_text()
        return Response(
            text, media_type="text/javascript", headers={"cache-control": "max-age=300"}
        )

    from assay_console.tenants import tenant_routes  # it builds on this module

    return [
        Route("/static/actions.js", script),
        Route("/static/proposals.js", script),
        Route("/api/runs/{run_id}/{verb}", guarded(run_action), methods=["POST"]),
        Route("/api/rollouts/{group}/cancel", guarded(rollout_cancel), methods=["POST"]),
        Route("/api/proposals/{proposal}/{verb}", guarded(review), methods=["POST"]),
        *tenant_routes(reads, access, publishing, guarded),
    ]


def _answer(
    request: Request,
    command: Command,
    done: bool,
    poll: str,
    run: RunDetail | None,
    proposal: ProposalView | None = None,
) -> Response:
    tenant = request.query_params.get("tenant")
    where = f"{poll}{'&' if '?' in poll else '?'}tenant={tenant}" if tenant else poll
    outcome = ActionOutcome(
        outcome="applied" if done else "pending",
        command=command_id(command),
        poll=where,
        run=run.run if run is not None else None,
        proposal=proposal,
    )
    return JSONResponse(outcome.model_dump(mode="json"), status_code=200 if done else 202)


def openapi_paths(ref: str, errors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The action endpoints' OpenAPI paths, and the schemas they name (`ref` formats a
    model's reference; `errors` are the common error answers)."""
    from pydantic.json_schema import models_json_schema

    from assay_console.tenants import openapi_paths as tenant_paths

    models: list[type[BaseModel]] = [ActionOutcome, *BODIES.values(), ReviewBody]

    def post(summary: str, body: str, params: list[dict[str, Any]]) -> dict[str, Any]:
        outcome = {"application/json": {"schema": {"$ref": ref.format(model="ActionOutcome")}}}
        content = {"application/json": {"schema": {"$ref": ref.format(model=body)}}}
        problem = errors["400"]["content"]
        return {
            "post": {
                "summary": summary,
                "parameters": [*params, *QUERY],
                "requestBody": {"required": True, "content": content},
                "responses": {
                    "200": {"description": "Applied: its effect was seen.", "content": outcome},
                    "202": {
                        "description": "Sent, not applied yet: poll `poll`.",
                        "content": outcome,
                    },
                    **errors,
                    "403": {"description": "A cross-site request.", "content": problem},
                    "409": {
                        "description": "Not in a state it applies to, or its stage refused it.",
                        "content": problem,
                    },
                    "415": {"description": "The body is not JSON.", "content": problem},
                    "503": {"description": "A read-only console.", "content": problem},
                },
            }
        }

    def path(name: str, text: str) -> dict[str, Any]:
        return {
            "name": name,
            "in": "path",
            "required": True,
            "description": text,
            "schema": {"type": "string"},
        }

    run = path("run_id", "The run (ULID).")
    paths = {
        f"/api/runs/{{run_id}}/{verb}": post(text, model.__name__, [run])
        for verb, model, text in [
            ("approve", ApproveBody, "Approve a run waiting for a human approval."),
            ("signal", SignalBody, "Send a named signal to a waiting run."),
            ("cancel", CancelBody, "Cancel a run."),
            ("rewind", RewindBody, "Fork a run at an LSN and drive the new branch."),
        ]
    }
    paths["/api/rollouts/{group}/cancel"] = post(
        "Cancel a rollout group (by its task's idempotency key).",
        "CancelBody",
        [path("group", "The group's idempotency key.")],
    )
    proposal = path("proposal", "The proposal (16 hex digits).")
    paths["/api/proposals/{proposal}/approve"] = post(
        "Approve a proposal: its version is registered and enters shadow.", "ReviewBody", [proposal]
    )
    paths["/api/proposals/{proposal}/reject"] = post(
        "Reject a proposal: the proposer is asked for the next one.", "ReviewBody", [proposal]
    )
    tenants, tenant_models = tenant_paths(ref, errors, post)
    paths |= tenants
    models += tenant_models
    _, defs = models_json_schema([(m, "serialization") for m in models], ref_template=ref)
    return paths, defs["$defs"]


QUERY = [
    {
        "name": "tenant",
        "in": "query",
        "required": False,
        "description": "Tenant (admin token only; a tenant token acts for its own).",
        "schema": {"type": "string"},
    },
    {
        "name": "wait",
        "in": "query",
        "required": False,
        "description": "Seconds to wait for the outcome (default 10, at most 30).",
        "schema": {"type": "number"},
    },
]
