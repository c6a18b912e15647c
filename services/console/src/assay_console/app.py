"""The console's HTTP app: the JSON API (the contract) and the pages built on it.

Every request acts for one identity (`access.py`). A tenant's token sees its own
tenant only: another tenant's run answers 404 exactly like a missing one. The admin
token (or an open loopback console) names the tenant with `?tenant=`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from importlib.resources import files
from typing import Any
from urllib.parse import quote

from jinja2 import Environment, PackageLoader, select_autoescape
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from assay.engine.episode_view import RunView
from assay.kernel import RunState
from assay.kernel.ids import TenantId, is_run_id, tenant_id
from assay.kernel.schema import one_line
from assay.runtime.settings import AssaySettings
from assay_console.access import Access, Caller
from assay_console.charts import (
    attempt_timeline,
    dag_chart,
    forest_chart,
    sprt_chart,
    time_chart,
)
from assay_console.outbox import Outbox
from assay_console.overview_series import series_routes, tenants_series
from assay_console.reads import MAX_KEY, BadQuery, ConsoleReads, RunFilters
from assay_console.runlog import RunLog, RunLogUnavailable
from assay_console.sessions import SESSION_COOKIE
from assay_console.spend_views import SpendReport, series
from assay_console.stages import NoStages, StageStatus
from assay_console.tree_views import RolloutGroupView, RunTree, run_tree
from assay_console.workflows import proposal_view

FILTERS = frozenset(RunFilters.model_fields)
PAGING = frozenset({"cursor", "limit", "tenant"})
DEFAULT_LIMIT = 50


class Problem(Exception):
    """An HTTP error with a message naming the problem."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


NOT_FOUND = "no such run"
NO_WORKFLOW = "no such workflow"
NO_PROPOSAL = "no such proposal"
MAX_WORKFLOW_ID = 256
PROPOSAL_ID = re.compile(r"[0-9a-f]{16}")


def caller(request: Request, access: Access) -> Caller:
    """Who a request acts for: its bearer token's, or its login session's.

    Raises:
        Problem: 401 when neither identifies anyone.
    """
    cookie = request.cookies.get(SESSION_COOKIE)
    found = access.caller(request.headers.get("authorization"), cookie)
    if found is None:
        raise Problem(401, "a bearer token (or a login) is required")
    return found


def _tenant(request: Request, access: Access) -> TenantId:
    """The tenant a request reads: its token's, or the admin's `?tenant=`."""
    who = caller(request, access).who
    asked = request.query_params.get("tenant")
    if who.tenant is not None:
        if asked is not None and asked != str(who.tenant):
            raise Problem(404, "no such tenant")
        return who.tenant
    if asked is None:
        raise Problem(400, "tenant: required with an admin token (?tenant=<uuid>)")
    try:
        return tenant_id(asked)
    except ValueError as exc:
        raise Problem(400, f"tenant: {asked!r} is not a UUID") from exc


def parse_filters(request: Request) -> tuple[RunFilters, str | None, int]:
    """The runs list's filters, cursor and limit from the query string.

    Raises:
        Problem: 400 naming an unknown parameter or a value that does not parse.
    """
    params = request.query_params
    unknown = sorted(set(params) - FILTERS - PAGING)
    if unknown:
        raise Problem(400, f"unknown filter: {', '.join(unknown)}")
    given = {k: v for k, v in params.items() if k in FILTERS and v != ""}
    try:
        filters = RunFilters.model_validate(given)
    except ValidationError as exc:
        raise Problem(400, one_line(exc)) from exc
    raw = params.get("limit") or str(DEFAULT_LIMIT)
    if not raw.isdigit() or int(raw) < 1:
        raise Problem(400, f"limit: {raw!r} is not a positive integer")
    return filters, params.get("cursor") or None, int(raw)


def _run_id(request: Request) -> str:
    run_id = str(request.path_params["run_id"])
    if not is_run_id(run_id):
        raise Problem(400, f"run id {run_id!r} is not a ULID")
    return run_id


def _workflow_id(request: Request) -> str:
    workflow_id = str(request.path_params["workflow_id"])
    if not workflow_id or len(workflow_id) > MAX_WORKFLOW_ID:
        raise Problem(400, f"workflow id: between 1 and {MAX_WORKFLOW_ID} characters")
    return workflow_id


def _proposal_id(request: Request) -> str:
    proposal = str(request.path_params["proposal"])
    if not PROPOSAL_ID.fullmatch(proposal):
        raise Problem(400, f"proposal id {proposal!r} is not 16 hex digits")
    return proposal


def _group(request: Request) -> str:
    group = str(request.path_params["group"])
    if not group or len(group) > MAX_KEY:
        raise Problem(400, f"rollout group: an idempotency key of 1 to {MAX_KEY} characters")
    return group


def _only_tenant(request: Request) -> None:
    extra = sorted(set(request.query_params) - {"tenant"})
    if extra:
        raise Problem(400, f"unknown parameter: {', '.join(extra)}")


Endpoint = Callable[[Request], Awaitable[Response]]


def login_url(request: Request) -> str:
    """The login page, coming back to this request's page once logged in."""
    here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return f"/login?next={quote(here, safe='')}"


def create_app(
    reads: ConsoleReads,
    access: Access,
    outbox: Outbox | None = None,
    settings: AssaySettings | None = None,
    run_log: RunLog | None = None,
    stages: StageStatus | None = None,
) -> Starlette:
    """The console app over `reads`, guarded by `access`; its actions publish to `outbox`
    (None: a read-only console); the spend page reads the ceilings from `settings` (None:
    it shows none, and says so); a run's full log is asked of `run_log` (None: not
    shown); the stages' health and lag are read by `stages` (None: it knows of none)."""
    env = Environment(
        loader=PackageLoader("assay_console", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
    )
    env.filters["when"] = lambda d: d.strftime("%Y-%m-%d %H:%M:%S UTC") if d else ""
    env.filters["ms_when"] = lambda ms: env.filters["when"](datetime.fromtimestamp(ms / 1000, UTC))
    env.filters["pct"] = lambda x: "-" if x is None else f"{x:.1%}"
    env.filters["short"] = lambda s: (s or "")[:12]
    env.filters["num"] = lambda x, digits=3: "-" if x is None else f"{x:.{digits}f}"
    env.filters["path"] = lambda s: quote(s, safe="")

    def guarded(fn: Callable[[Request], Awaitable[Response]], html: bool = False) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            try:
                return await fn(request)
            except (Problem, BadQuery) as exc:
                status = exc.status if isinstance(exc, Problem) else 400
                detail = exc.detail if isinstance(exc, Problem) else str(exc)
                if html and status == 401 and request.method == "GET":
                    return RedirectResponse(login_url(request), status_code=303)
                if html:
                    page = env.get_template("problem.html").render(status=status, detail=detail)
                    return HTMLResponse(page, status_code=status)
                return JSONResponse({"detail": detail}, status_code=status)

        return endpoint

    async def api_runs(request: Request) -> Response:
        filters, cursor, limit = parse_filters(request)
        page = await reads.runs(_tenant(request, access), filters, cursor, limit)
        return Response(page.model_dump_json(), media_type="application/json")

    async def api_run(request: Request) -> Response:
        run_id = _run_id(request)
        detail = await reads.run(_tenant(request, access), run_id)
        if detail is None:
            raise Problem(404, NOT_FOUND)
        return Response(detail.model_dump_json(), media_type="application/json")

    async def full_log(tenant: TenantId, run_id: str) -> dict[str, Any]:
        if await reads.run(tenant, run_id) is None:
            raise Problem(404, NOT_FOUND)  # the console's own record decides, in both modes
        if run_log is None:
            raise Problem(503, "this console has no way to ask execute for a run's log")
        try:
            view = await run_log.view(tenant, run_id)
        except RunLogUnavailable as exc:
            raise Problem(502, f"execute: {exc}") from exc
        if view is None:
            raise Problem(404, "execute has no log of this run")
        return view

    async def api_run_log(request: Request) -> Response:
        _only_tenant(request)
        run_id = _run_id(request)
        return JSONResponse(await full_log(_tenant(request, access), run_id))

    async def tree_of(tenant: TenantId, run_id: str) -> RunTree:
        return run_tree(RunView.model_validate(await full_log(tenant, run_id)))

    async def api_run_tree(request: Request) -> Response:
        _only_tenant(request)
        run_id = _run_id(request)
        tree = await tree_of(_tenant(request, access), run_id)
        return Response(tree.model_dump_json(), media_type="application/json")

    async def rollout_of(tenant: TenantId, group: str) -> RolloutGroupView:
        runs = await reads.group_runs(tenant, group)
        result = await reads.rollout_result(tenant, group)
        if not runs and result is None:
            raise Problem(404, "no such rollout group")
        return RolloutGroupView(group=group, runs=runs, result=result)

    async def api_rollout(request: Request) -> Response:
        _only_tenant(request)
        group = _group(request)
        view = await rollout_of(_tenant(request, access), group)
        return Response(view.model_dump_json(), media_type="application/json")

    async def api_overview(request: Request) -> Response:
        _only_tenant(request)
        overview = await reads.overview(_tenant(request, access))
        return Response(overview.model_dump_json(), media_type="application/json")

    async def api_workflows(request: Request) -> Response:
        _only_tenant(request)
        listed = await reads.workflows(_tenant(request, access))
        return Response(listed.model_dump_json(), media_type="application/json")

    async def api_workflow(request: Request) -> Response:
        _only_tenant(request)
        workflow_id = _workflow_id(request)
        detail = await reads.workflow(_tenant(request, access), workflow_id)
        if detail is None:
            raise Problem(404, NO_WORKFLOW)
        return Response(detail.model_dump_json(), media_type="application/json")

    async def api_proposals(request: Request) -> Response:
        _only_tenant(request)
        listed = await reads.proposals(_tenant(request, access))
        return Response(listed.model_dump_json(), media_type="application/json")

    async def api_proposal(request: Request) -> Response:
        _only_tenant(request)
        proposal = _proposal_id(request)
        row = await reads.proposal(_tenant(request, access), proposal)
        if row is None:
            raise Problem(404, NO_PROPOSAL)
        return Response(proposal_view(row).model_dump_json(), media_type="application/json")

    async def spend_report(request: Request) -> tuple[TenantId, SpendReport]:
        extra = sorted(set(request.query_params) - {"tenant", "days", "bucket"})
        if extra:
            raise Problem(400, f"unknown parameter: {', '.join(extra)}")
        raw = request.query_params.get("days", "7")
        if not raw.isdigit():
            raise Problem(400, f"days: {raw!r} is not a whole number of days")
        bucket = request.query_params.get("bucket", "day")
        tenant = _tenant(request, access)
        return tenant, await reads.spend(tenant, int(raw), bucket, settings)

    async def api_spend(request: Request) -> Response:
        _, report = await spend_report(request)
        return Response(report.model_dump_json(), media_type="application/json")

    async def page_spend(request: Request) -> Response:
        tenant, report = await spend_report(request)
        xs, by_metric = series(report, datetime.now(UTC))
        limits = {c.purpose: c.limit for c in report.ceilings if c.unit == "calls" and c.limit}
        charts = {
            metric: time_chart(
                xs, lines, limits if metric == "calls" and report.bucket == "day" else {}
            )
            for metric, lines in by_metric.items()
        }
        rounds = report.judge.rounds
        judge = (
            time_chart(
                [r.at.strftime("%m-%d %H:%M") for r in rounds],
                {
                    "agreement": [r.agreement or 0.0 for r in rounds],
                    "order inconsistency": [r.order_inconsistency_rate or 0.0 for r in rounds],
                },
                {"min agreement": report.judge.min_agreement or 0.0},
                y_max=1.0,
            )
            if rounds
            else None
        )
        return render("spend.html", r=report, tenant=tenant, charts=charts, judge=judge)

    async def api_openapi(request: Request) -> Response:
        from assay_console.openapi import document

        return JSONResponse(document())

    stage_status = stages if stages is not None else NoStages()

    def render(name: str, **context: Any) -> HTMLResponse:
        return HTMLResponse(env.get_template(name).render(**context))

    async def page_overview(request: Request) -> Response:
        who = caller(request, access).who
        if who.tenant is None and "tenant" not in request.query_params:
            tenants = await reads.tenants()
            views = [await reads.overview(t) for t in tenants]
        else:
            views = [await reads.overview(_tenant(request, access))]
        series = await tenants_series(reads.table, [v.tenant for v in views], request.query_params)
        shown = await stages_context(stage_status)
        return render("overview.html", views=views, open=access.open, series=series, **shown)

    async def page_runs(request: Request) -> Response:
        filters, cursor, limit = parse_filters(request)
        tenant = _tenant(request, access)
        page = await reads.runs(tenant, filters, cursor, limit)
        base = {k: v for k, v in request.query_params.items() if k != "cursor"}
        template = "runs_rows.html" if request.headers.get("x-console-poll") else "runs.html"
        return render(
            template,
            page=page,
            tenant=tenant,
            filters=filters,
            base=base,
            first=cursor is None,
            states=[s.value for s in RunState],
        )

    async def page_run(request: Request) -> Response:
        run_id = _run_id(request)
        tenant = _tenant(request, access)
        detail = await reads.run(tenant, run_id)
        if detail is None:
            raise Problem(404, NOT_FOUND)
        pretty = json.dumps(detail.input, indent=2, sort_keys=True) if detail.input else None
        key = detail.run.idempotency_key
        grouped = await reads.rollout_result(tenant, key) is not None
        attempts, tree, missing = None, None, None
        try:
            view = RunView.model_validate(await full_log(tenant, run_id))
            attempts, tree = attempt_timeline(view), run_tree(view)
        except Problem as exc:
            missing = exc.detail
        return render(
            "run.html",
            d=detail,
            tenant=tenant,
            input_json=pretty,
            attempts=attempts,
            tree=tree,
            missing=missing,
            grouped=grouped,
        )

    async def page_rollout(request: Request) -> Response:
        _only_tenant(request)
        group = _group(request)
        tenant = _tenant(request, access)
        view = await rollout_of(tenant, group)
        return render("rollout.html", g=view, tenant=tenant)

    async def page_run_tree(request: Request) -> Response:
        _only_tenant(request)
        run_id = _run_id(request)
        tenant = _tenant(request, access)
        detail = await reads.run(tenant, run_id)
        if detail is None:
            raise Problem(404, NOT_FOUND)
        tree = await tree_of(tenant, run_id)
        return render("run_tree.html", d=detail, tenant=tenant, tree=tree)

    async def page_workflows(request: Request) -> Response:
        _only_tenant(request)
        tenant = _tenant(request, access)
        listed = await reads.workflows(tenant)
        return render("workflows.html", listed=listed, tenant=tenant)

    async def page_workflow(request: Request) -> Response:
        _only_tenant(request)
        workflow_id = _workflow_id(request)
        tenant = _tenant(request, access)
        detail = await reads.workflow(tenant, workflow_id)
        if detail is None:
            raise Problem(404, NO_WORKFLOW)
        charts = [
            (c, sprt_chart(c.sprt), forest_chart(c.strengths) if c.strengths else None)
            for c in detail.challengers
        ]
        dag = dag_chart(detail.versions)
        polled = request.headers.get("x-console-poll")
        template = "workflow_body.html" if polled else "workflow.html"
        return render(template, d=detail, tenant=tenant, charts=charts, dag=dag)

    async def page_proposals(request: Request) -> Response:
        _only_tenant(request)
        tenant = _tenant(request, access)
        listed = await reads.proposals(tenant)
        return render("proposals.html", listed=listed, tenant=tenant)

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in ("console.js", "console.css"):
            raise Problem(404, "no such file")
        body = files("assay_console").joinpath("static", name).read_text()
        kind = "text/javascript" if name.endswith(".js") else "text/css"
        return Response(body, media_type=kind, headers={"cache-control": "max-age=300"})

    async def healthz(request: Request) -> Response:
        return JSONResponse({"ok": True})

    routes = [
        Route("/api/runs", guarded(api_runs)),
        Route("/api/runs/{run_id}", guarded(api_run)),
        Route("/api/runs/{run_id}/log", guarded(api_run_log), methods=["GET"]),
        Route("/api/runs/{run_id}/tree", guarded(api_run_tree), methods=["GET"]),
        Route("/api/rollouts/{group:path}", guarded(api_rollout), methods=["GET"]),
        Route("/api/overview", guarded(api_overview)),
        Route("/api/workflows", guarded(api_workflows)),
        Route("/api/workflows/{workflow_id:path}", guarded(api_workflow)),
        Route("/api/proposals", guarded(api_proposals)),
        Route("/api/proposals/{proposal}", guarded(api_proposal)),
        Route("/api/spend", guarded(api_spend)),
        Route("/api/openapi.json", api_openapi),
        Route("/", guarded(page_overview, html=True)),
        Route("/runs", guarded(page_runs, html=True)),
        Route("/runs/{run_id}", guarded(page_run, html=True)),
        Route("/runs/{run_id}/tree", guarded(page_run_tree, html=True)),
        Route("/rollouts/{group:path}", guarded(page_rollout, html=True)),
        Route("/workflows", guarded(page_workflows, html=True)),
        Route("/proposals", guarded(page_proposals, html=True)),
        Route("/spend", guarded(page_spend, html=True)),
        Route("/workflows/{workflow_id:path}", guarded(page_workflow, html=True)),
        Route("/static/{name}", guarded(static, html=True)),
        Route("/healthz", healthz),
    ]
    from assay_console.actions import action_routes  # it builds on this module
    from assay_console.login import login_routes
    from assay_console.stage_routes import stage_routes, stages_context

    routes[:0] = [
        *action_routes(reads, access, outbox, guarded),
        *login_routes(access, env),
        *stage_routes(stage_status, access, env, guarded),
    ]
    routes[:0] = series_routes(reads.table, lambda r: _tenant(r, access), guarded, render)
    app = Starlette(routes=routes)
    app.add_middleware(_SecurityHeaders)
    return app


class _SecurityHeaders:
    """A content security policy that allows only the app's own script and style."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [
                    *message["headers"],
                    (b"content-security-policy", b"default-src 'self'; frame-ancestors 'none'"),
                    (b"x-content-type-options", b"nosniff"),
                    (b"referrer-policy", b"no-referrer"),
                ]
            await send(message)

        await self.app(scope, receive, sending)
