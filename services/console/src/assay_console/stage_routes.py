"""`GET /api/stages` and the overview's Stages section (`/stages`, which the overview
polls): each stage's health and lag, read by a `StageStatus` (`stages.py`).

Any caller the console admits may read them, admin or tenant: they are figures of the
shared topics and processes, with no tenant's id or data in them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jinja2 import Environment
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from assay_console.access import Access
from assay_console.app import Endpoint, Problem, caller
from assay_console.stages import StageStatus, lag_bars


async def stages_context(status: StageStatus) -> dict[str, Any]:
    """What `_stages.html` draws: the stages' view and each one's lag bar."""
    view = await status.read()
    return {"stages": view, "lag_bars": lag_bars(view)}


def stage_routes(
    status: StageStatus,
    access: Access,
    env: Environment,
    guarded: Callable[..., Endpoint],
) -> list[Route]:
    """`/api/stages` (JSON) and `/stages` (the page, or its section when polled)."""

    def admitted(request: Request) -> None:
        caller(request, access)
        if request.query_params:
            raise Problem(400, f"unknown parameter: {', '.join(sorted(request.query_params))}")

    async def api_stages(request: Request) -> Response:
        admitted(request)
        view = await status.read()
        return Response(view.model_dump_json(), media_type="application/json")

    async def page_stages(request: Request) -> Response:
        admitted(request)
        polled = request.headers.get("x-console-poll")
        name = "_stages.html" if polled else "stages.html"
        return HTMLResponse(env.get_template(name).render(**await stages_context(status)))

    return [
        Route("/api/stages", guarded(api_stages), methods=["GET"]),
        Route("/stages", guarded(page_stages, html=True), methods=["GET"]),
    ]
