"""Deleting a tenant from the console's API: the admin token alone.

`POST /api/tenants/{tenant}/delete` produces the `TenantDeleted` the CLI produces
(`assay.bus.commands.delete_tenant`), with the same checks as every other action (a
same-site JSON body). A tenant is known to the console when its read model holds a
workflow or a run of it; an unknown one answers 404 and nothing is sent. The answer
is 200 once the console's own read model deleted the tenant (each stage deletes its
own part; `assay tenant status` reads every stage's), 202 before. A tenant the console
already deleted answers 200 at once, sending nothing. `GET /api/tenants/{tenant}/deletion`
says where the console's part stands.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from assay.bus import commands
from assay.bus.commands import CommandInvalid
from assay.kernel.ids import TenantId, tenant_id
from assay_console.access import Access
from assay_console.actions import ActionOutcome, body, command_id, same_site, settle, wait_s
from assay_console.app import Endpoint, Problem
from assay_console.outbox import Outbox
from assay_console.reads import ConsoleReads

NO_TENANT = "no such tenant"


class DeleteTenantBody(BaseModel):
    """Deleting a tenant."""

    model_config = ConfigDict(extra="forbid")
    reason: str = Field("", max_length=2000, description="Why, recorded in each tombstone.")


class TenantDeletion(BaseModel):
    """Where a tenant's deletion stands in the console's own read model."""

    tenant: str = Field(description="The tenant.")
    deleted: bool = Field(description="The console deleted what it held of the tenant.")
    command: str | None = Field(None, description="Message id of the deletion carried out.")
    reason: str | None = Field(None, description="Why, as the command said.")
    at_ms: int | None = Field(None, description="When the console deleted it (ms since epoch).")


def _admin_tenant(request: Request, access: Access) -> TenantId:
    """The path's tenant, for the admin token only.

    Raises:
        Problem: 401 without a token, 403 for a tenant's token, 400 for a bad tenant.
    """
    who = access.identify(request.headers.get("authorization"))
    if who is None:
        raise Problem(401, "a bearer token is required")
    if who.tenant is not None:
        raise Problem(403, "only the admin token deletes a tenant")
    if extra := sorted(set(request.query_params) - {"wait"}):
        raise Problem(400, f"unknown parameter: {', '.join(extra)}")
    raw = str(request.path_params["tenant"])
    try:
        return tenant_id(raw)
    except ValueError as exc:
        raise Problem(400, f"tenant: {raw!r} is not a UUID") from exc


def tenant_routes(
    reads: ConsoleReads,
    access: Access,
    publishing: Callable[[], Outbox],
    guarded: Callable[[Callable[[Request], Awaitable[Response]]], Endpoint],
) -> list[Route]:
    """The tenant endpoints (`publishing` gives the outbox, or answers 503)."""

    async def deletion(request: Request) -> Response:
        tenant = _admin_tenant(request, access)
        stone = await reads.tombstone(tenant)
        if stone is None and not await reads.knows(tenant):
            raise Problem(404, NO_TENANT)
        view = TenantDeletion(tenant=str(tenant), deleted=stone is not None)
        if stone is not None:
            view = TenantDeletion(tenant=str(tenant), deleted=True, **stone.model_dump())
        return JSONResponse(view.model_dump(mode="json"))

    async def delete(request: Request) -> Response:
        same_site(request, access)
        tenant = _admin_tenant(request, access)
        given = await body(request, DeleteTenantBody)
        if not await reads.knows(tenant):
            raise Problem(404, NO_TENANT)
        try:
            command = commands.delete_tenant(tenant, given.reason)
        except CommandInvalid as exc:
            raise Problem(400, str(exc)) from exc
        poll = f"/api/tenants/{tenant}/deletion"
        if await reads.tombstone(tenant) is not None:  # deleted before: nothing to send
            done = True
        else:

            async def seen() -> bool:
                return await reads.tombstone(tenant) is not None

            done = await settle(publishing(), command, seen, wait_s(request))
        outcome = ActionOutcome(
            outcome="applied" if done else "pending", command=command_id(command), poll=poll
        )
        return JSONResponse(outcome.model_dump(mode="json"), status_code=200 if done else 202)

    return [
        Route("/api/tenants/{tenant}/delete", guarded(delete), methods=["POST"]),
        Route("/api/tenants/{tenant}/deletion", guarded(deletion)),
    ]


def openapi_paths(
    ref: str, errors: dict[str, Any], post: Callable[..., dict[str, Any]]
) -> tuple[dict[str, Any], list[type[BaseModel]]]:
    """The tenant endpoints' OpenAPI paths (`post` builds an action's), and their models."""
    tenant = {
        "name": "tenant",
        "in": "path",
        "required": True,
        "description": "The tenant (UUID).",
        "schema": {"type": "string"},
    }
    deleted = {"application/json": {"schema": {"$ref": ref.format(model="TenantDeletion")}}}
    problem = errors["400"]["content"]
    forbidden = {"description": "A tenant's token: only the admin deletes.", "content": problem}
    action = post("Delete a tenant (admin token only).", "DeleteTenantBody", [tenant])
    action["post"]["parameters"] = [  # the tenant is the path's, not the query's
        p for p in action["post"]["parameters"] if (p["in"], p["name"]) != ("query", "tenant")
    ]
    action["post"]["responses"]["403"] = {
        "description": "A cross-site request, or a tenant's token.",
        "content": problem,
    }
    paths = {
        "/api/tenants/{tenant}/delete": action,
        "/api/tenants/{tenant}/deletion": {
            "get": {
                "summary": "Where the console's part of a tenant's deletion stands (admin only).",
                "parameters": [tenant],
                "responses": {
                    "200": {"description": "Its state.", "content": deleted},
                    **errors,
                    "403": forbidden,
                },
            }
        },
    }
    return paths, [DeleteTenantBody, TenantDeletion]
