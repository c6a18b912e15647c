"""The console API's OpenAPI document, generated from the response models.

`schemas/console-openapi.json` is this document, committed; a test keeps them equal
(`make schemas` rewrites it with the rest of `schemas/`, as does `assay-console-openapi`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pydantic.json_schema import models_json_schema

from assay.engine.episode_view import RunView
from assay_console.overview_series import BUCKETS, MAX_BUCKETS, WINDOWS, OverviewSeries
from assay_console.reads import Overview, RunDetail, RunFilters, RunsPage
from assay_console.spend_views import SpendReport
from assay_console.stages import StagesView
from assay_console.tree_views import RolloutGroupView, RunTree
from assay_console.workflow_views import (
    ProposalsList,
    ProposalView,
    WorkflowDetail,
    WorkflowsList,
)

REF = "#/components/schemas/{model}"


def _param(name: str, description: str, schema: dict[str, Any], where: str = "query") -> Any:
    return {
        "name": name,
        "in": where,
        "required": where == "path",
        "description": description,
        "schema": schema,
    }


def _errors() -> dict[str, Any]:
    problem = {"$ref": REF.format(model="Problem")}
    return {
        str(code): {"description": text, "content": {"application/json": {"schema": problem}}}
        for code, text in [
            (400, "Bad input: the detail names the parameter."),
            (401, "No bearer token, or an unknown one."),
            (
                404,
                "No such run, workflow, proposal or tenant, or another tenant's (the same answer).",
            ),
        ]
    }


def document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of `/api`."""
    _, defs = models_json_schema(
        [
            (m, "serialization")
            for m in (
                RunsPage,
                RunDetail,
                Overview,
                OverviewSeries,
                WorkflowsList,
                WorkflowDetail,
                ProposalsList,
                ProposalView,
                SpendReport,
                RunView,
                RunTree,
                RolloutGroupView,
                StagesView,
            )
        ],
        ref_template=REF,
    )
    schemas = dict(sorted(defs["$defs"].items()))
    schemas["Problem"] = {
        "type": "object",
        "properties": {"detail": {"type": "string", "description": "What is wrong."}},
        "required": ["detail"],
    }
    tenant = _param(
        "tenant", "Tenant (admin token only; a tenant token reads its own).", {"type": "string"}
    )
    filters = []
    for name, info in RunFilters.model_fields.items():
        schema: dict[str, Any] = {"type": "string"}
        if name == "passed":
            schema = {"type": "boolean"}
        elif name in ("since", "until"):
            schema = {"type": "string", "format": "date-time"}
        elif name == "state":
            schema = {"$ref": REF.format(model="RunState")}
        filters.append(_param(name, info.description or name, schema))
    if "RunState" not in schemas:
        from assay.kernel import RunState

        schemas["RunState"] = {"type": "string", "enum": [s.value for s in RunState]}

    def ok(model: str, text: str) -> dict[str, Any]:
        content = {"application/json": {"schema": {"$ref": REF.format(model=model)}}}
        return {"200": {"description": text, "content": content}, **_errors()}

    paging = [
        _param("limit", "Page size (the server caps it at 200).", {"type": "integer"}),
        _param("cursor", "Opaque cursor from the previous page.", {"type": "string"}),
    ]
    run_id = _param("run_id", "The run (ULID).", {"type": "string"}, where="path")
    workflow_id = _param(
        "workflow_id",
        "The workflow (URL-encoded; at most 256 characters).",
        {"type": "string"},
        where="path",
    )
    proposal = _param("proposal", "The proposal (16 hex digits).", {"type": "string"}, "path")
    from assay_console.actions import openapi_paths

    actions, action_schemas = openapi_paths(REF, _errors())
    schemas = dict(sorted((schemas | action_schemas).items()))
    return {
        "openapi": "3.1.0",
        "info": {"title": "Assay console API", "version": "1"},
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": {
            "/api/runs": {
                "get": {
                    "summary": "A tenant's runs, newest first, filtered, one keyset page.",
                    "parameters": [tenant, *filters, *paging],
                    "responses": ok("RunsPage", "One page."),
                }
            },
            "/api/runs/{run_id}": {
                "get": {
                    "summary": "One run: timeline, verdict, score, usage, input, output.",
                    "parameters": [run_id, tenant],
                    "responses": ok("RunDetail", "The run."),
                }
            },
            "/api/runs/{run_id}/log": {
                "get": {
                    "summary": (
                        "A run's full log, asked of the execute stage (which alone holds "
                        "it): its branches, steps, attempts with state and duration, and "
                        "intents — the view `assay runs show --json` prints."
                    ),
                    "parameters": [run_id, tenant],
                    "responses": {
                        **ok("RunView", "The run's log view."),
                        **_asked_of_execute(),
                    },
                }
            },
            "/api/runs/{run_id}/tree": {
                "get": {
                    "summary": (
                        "A run's intents, each with every state it reached and when, and its "
                        "branch tree: each branch's parent, fork LSN and discarded effects, "
                        "and each branch command's children with their deltas, first "
                        "divergence, execution status and verifier outcome. From execute's "
                        "log, like `/log`."
                    ),
                    "parameters": [run_id, tenant],
                    "responses": {
                        **ok("RunTree", "The run's intents and branch tree."),
                        **_asked_of_execute(),
                    },
                }
            },
            "/api/rollouts/{group}": {
                "get": {
                    "summary": (
                        "A rollout group, named by its task's idempotency key: the runs that "
                        "share the key and, once the group closed, its result — each "
                        "sibling's outcome, the selection and its evidence, the winner."
                    ),
                    "parameters": [
                        _param(
                            "group",
                            "The group's idempotency key (URL-encoded; at most 500 characters).",
                            {"type": "string"},
                            where="path",
                        ),
                        tenant,
                    ],
                    "responses": ok("RolloutGroupView", "The group."),
                }
            },
            "/api/overview": {
                "get": {
                    "summary": "A tenant at a glance.",
                    "parameters": [tenant],
                    "responses": ok("Overview", "The overview."),
                }
            },
            "/api/overview/series": {
                "get": {
                    "summary": (
                        "A tenant over time, bucket by bucket: tasks in, results out, pass "
                        "rate, throughput and end-to-end latency (p50, p95)."
                    ),
                    "parameters": [
                        tenant,
                        _param(
                            "window",
                            "The span shown, ending at `end` (default 24h).",
                            {"type": "string", "enum": list(WINDOWS)},
                        ),
                        _param(
                            "bucket",
                            "Bucket size, UTC-aligned (default by window: 1h→1m, 6h→5m, "
                            f"24h→1h, 7d→1h, 30d→1d); at most {MAX_BUCKETS} buckets.",
                            {"type": "string", "enum": list(BUCKETS)},
                        ),
                        _param(
                            "end",
                            "End of the span, ISO 8601 (default now; no zone: UTC).",
                            {"type": "string", "format": "date-time"},
                        ),
                    ],
                    "responses": ok("OverviewSeries", "The tenant's buckets, oldest first."),
                }
            },
            "/api/stages": {
                "get": {
                    "summary": (
                        "Each stage's health (ready, not ready and why, unreachable; embedded: "
                        "running) and lag per topic and partition, with messages handled and "
                        "handling time p50/p95: read from each stage's `/readyz` and "
                        "`/metrics` (distributed, the status ports `ASSAY_CONSOLE_STAGE_URLS` "
                        "names) or from the process's own metrics (embedded). Figures of the "
                        "shared topics, with no tenant's data: any admitted caller may read "
                        "them; it takes no parameter."
                    ),
                    "parameters": [],
                    "responses": ok("StagesView", "The stages, in the order configured."),
                }
            },
            "/api/workflows": {
                "get": {
                    "summary": "A tenant's workflows: current version, challenger and its rung.",
                    "parameters": [tenant],
                    "responses": ok("WorkflowsList", "The workflows, by id."),
                }
            },
            "/api/workflows/{workflow_id}": {
                "get": {
                    "summary": (
                        "One workflow's ladder: version DAG, allocations, each challenger's "
                        "sequential test path, record, pass rates and strengths, decisions "
                        "and proposals."
                    ),
                    "parameters": [workflow_id, tenant],
                    "responses": ok("WorkflowDetail", "The workflow."),
                }
            },
            "/api/spend": {
                "get": {
                    "summary": (
                        "A tenant's model calls, tokens and dollars by purpose over time, "
                        "its spend ceilings with today's use, and its judge's calibration "
                        "rounds (agreement with the verifier, order inconsistency)."
                    ),
                    "parameters": [
                        tenant,
                        _param(
                            "days",
                            "UTC days back, today included (1 to 90; default 7).",
                            {"type": "integer"},
                        ),
                        _param(
                            "bucket",
                            "`day` (default) or `hour`.",
                            {"type": "string", "enum": ["day", "hour"]},
                        ),
                    ],
                    "responses": ok("SpendReport", "The spend report."),
                }
            },
            "/api/proposals": {
                "get": {
                    "summary": "A tenant's open proposals: waiting for review, oldest first.",
                    "parameters": [tenant],
                    "responses": ok("ProposalsList", "The open proposals."),
                }
            },
            "/api/proposals/{proposal}": {
                "get": {
                    "summary": "One proposal and where its review stands.",
                    "parameters": [proposal, tenant],
                    "responses": ok("ProposalView", "The proposal."),
                }
            },
            **actions,
        },
    }


def rendered() -> str:
    """The committed file's text."""
    return json.dumps(document(), indent=2, sort_keys=True) + "\n"


def main() -> None:
    """Write the document to the path given (default: schemas/console-openapi.json)."""
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "schemas/console-openapi.json")
    path.write_text(rendered())
    print(path)


def _asked_of_execute() -> dict[str, Any]:
    """The answers of a route that asks execute for a run's log (`runlog.py`)."""
    errors = _errors()["400"]["content"]
    return {
        "502": {"description": "Execute did not answer, or the run was tiered.", "content": errors},
        "503": {"description": "This console has no way to ask execute.", "content": errors},
    }
