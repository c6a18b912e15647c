"""The `assay` command line. Errors are one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

from assay.kernel.errors import AssayError


class UsageError(AssayError):
    """Bad command-line input."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="assay",
        description=("Run AI-agent workflows durably, verify them, grade them, improve them."),
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="data directory (default: $ASSAY_DATA_DIR or ./assay-data)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log stage warnings")
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo", help="v1 current, v2 up the promotion ladder, v3 rolled back, example tasks"
    )
    demo.add_argument("--tasks", type=Path, default=None, help="JSONL tasks (default: examples)")
    demo.add_argument(
        "--workflows",
        type=Path,
        nargs="+",
        default=None,
        metavar="FILE",
        help="workflow files: the current version, then one or two challengers in turn",
    )
    demo.add_argument(
        "--challengers",
        type=int,
        default=None,
        metavar="N",
        help="tournament-graded: N challengers climb at once, the strongest is promoted",
    )
    demo.add_argument("--limit", type=int, default=None, help="submit only the first N tasks")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="N",
        help="serve /metrics, /healthz and /readyz on 127.0.0.1:N while the demo runs",
    )
    demo.add_argument(
        "--console-port",
        type=int,
        default=None,
        metavar="N",
        help="serve the console on 127.0.0.1:N (default: $ASSAY_CONSOLE_PORT, else any free)",
    )
    demo.add_argument("--no-console", action="store_true", help="do not serve the console")
    console = sub.add_parser(
        "console", help="serve the operator console over the data directory's topics"
    )
    console.add_argument("--host", default=None, help="address (default: $ASSAY_CONSOLE_HOST)")
    console.add_argument(
        "--port", type=int, default=None, help="port (default: $ASSAY_CONSOLE_PORT)"
    )
    embedded = sub.add_parser(
        "serve-embedded",
        help="run every stage on the data directory until stopped, serving on one port",
        description=(
            "Every installed stage in one process on the data directory until SIGTERM or"
            " SIGINT. One port carries the console (when installed) and its API, /metrics,"
            " /healthz, /readyz, task intake and workflow registration."
        ),
    )
    embedded.add_argument("--host", default=None, help="address (default: $ASSAY_CONSOLE_HOST)")
    embedded.add_argument(
        "--port", type=int, default=None, help="port (default: $ASSAY_CONSOLE_PORT; 0: any)"
    )
    for name, what in [
        ("p0", "win rate under H0"),
        ("p1", "win rate under H1"),
        ("alpha", "false-accept rate"),
        ("beta", "false-reject rate"),
        ("draw-ceiling", "reject above this draw rate"),
    ]:
        demo.add_argument(
            f"--{name}",
            type=float,
            default=None,
            help=f"SPRT {what} (else ASSAY_SPRT_{name.upper().replace('-', '_')})",
        )

    run = sub.add_parser("run", help="one durable run of a workflow; prints the episode")
    run.add_argument("workflow", type=Path, help="workflow file (YAML or JSON)")
    run.add_argument("--input", required=True, help="task input as a JSON object")

    rebuild = sub.add_parser(
        "rebuild",
        help="re-fold every stage's derived state from its log",
        description=(
            "Re-fold each stage's derived state from its log: the data directory's stores,"
            " or, given --database-url or ASSAY_DATABASE_URL, each stage's schema in that"
            " Postgres database (--check only: read in one read-only snapshot)."
        ),
    )
    rebuild.add_argument(
        "--check",
        action="store_true",
        help="compare byte for byte and change nothing; exit 1 on a difference",
    )
    rebuild.add_argument(
        "--database-url",
        default=None,
        metavar="URL",
        help="check the stage schemas of this Postgres database (default: $ASSAY_DATABASE_URL;"
        " an admin URL reads every stage, a stage's own role its schema alone)",
    )
    rebuild.add_argument(
        "--stage",
        dest="stages",
        action="append",
        default=None,
        metavar="STAGE",
        help="only this stage (repeat for more; default: every stage found)",
    )
    runs = sub.add_parser("runs", help="inspect runs in the execute stage's log")
    runs_sub = runs.add_subparsers(dest="runs_command", required=True)
    show = runs_sub.add_parser(
        "show",
        help="a run's branches, attempts and intents, from its log alone",
        description=(
            "Show a run's live branch (the highest-numbered one), or --branch N, or all of"
            " them, from the execute log: the data directory's, or Postgres's when"
            " ASSAY_DATABASE_URL is set."
        ),
    )
    show.add_argument("run", help="run id")
    show.add_argument("--tenant", default=None, help="the run's tenant UUID (default: its own)")
    which = show.add_mutually_exclusive_group()
    which.add_argument(
        "--branch", type=int, default=None, help="show this branch (default: the live one)"
    )
    which.add_argument("--all-branches", action="store_true", help="show every branch")
    show.add_argument("--json", action="store_true", help="print JSON with stable keys")
    listing = runs_sub.add_parser(
        "list",
        help="the console's runs list, newest first (filtered, one page)",
        description="One page of a tenant's runs from the console's store in the data directory.",
    )
    listing.add_argument("--tenant", default=None, help="tenant UUID (default: the only one)")
    for name in ("workflow", "version", "state", "passed", "since", "until", "key", "cursor"):
        listing.add_argument(f"--{name}", default=None, help=f"the API's `{name}` parameter")
    listing.add_argument("--limit", default=None, help="page size (at most 200)")
    listing.add_argument("--json", action="store_true", help="print the API's JSON")
    serve = sub.add_parser("serve", help="run one stage against Kafka, Postgres and S3")
    serve.add_argument("stage", help="ingest, execute, verify, tournament, aggregate or decide")
    db = sub.add_parser("db", help="database administration")
    db.add_argument("action", choices=["provision"], help="create each stage's role and schema")
    topics = sub.add_parser("topics", help="Kafka topic administration")
    topics.add_argument("action", choices=["create"], help="create every topic if missing")
    register = sub.add_parser("register", help="register a workflow version on assay.workflows")
    register.add_argument("workflow", type=Path, help="workflow file (YAML or JSON)")
    register.add_argument("--tenant", default=None, help="tenant UUID (default: local)")
    register.add_argument("--rewrite", action="store_true", help="allow retaining no step id")
    register.add_argument(
        "--parent",
        dest="parents",
        action="append",
        default=None,
        metavar="VERSION",
        help="a version it derives from (repeat for a merge; default: the latest)",
    )
    submit = sub.add_parser("submit", help="produce tasks from a JSONL file onto assay.tasks")
    submit.add_argument("file", type=Path, help="one TaskSubmitted JSON object per line")
    submit.add_argument("--tenant", default=None, help="tenant for lines without one")
    submit.add_argument("--workflow", default=None, help="workflow for lines without one")
    submit.add_argument(
        "--candidate",
        dest="candidates",
        action="append",
        default=None,
        metavar="[NAME][*K]:KIND=VALUE",
        help=(
            "run each task as a replay tournament: one candidate per flag (version=HASH|current,"
            " model=NAME, prompt=TEMPLATE or prompt.STEP=TEMPLATE), running K siblings"
            " (default 1)"
        ),
    )
    submit.add_argument(
        "--candidates",
        dest="matrix",
        type=Path,
        default=None,
        metavar="FILE",
        help="a candidate matrix (YAML or JSON): a list, or a rollout spec with candidates",
    )
    submit.add_argument(
        "--control", default=None, help="the candidate pinned as control (default: current)"
    )
    submit.add_argument(
        "--wait",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=(
            "wait for ingest's verdict on each task, print it, exit 1 if one was refused"
            " (default: with a candidate matrix)"
        ),
    )
    submit.add_argument(
        "--wait-s",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long --wait waits for the verdicts (exit 3 if one is missing; default 60)",
    )
    cancel = sub.add_parser(
        "cancel",
        help="stop a run (CancelRun onto assay.run-commands) or, with --rollout, a rollout group",
    )
    cancel.add_argument("run", help="the run id; with --rollout, the group's task key")
    cancel.add_argument(
        "--rollout",
        action="store_true",
        help="RUN names a rollout group by its task's idempotency key: CancelRollout",
    )
    cancel.add_argument("--tenant", default=None, help="the run's tenant (default: ASSAY_TENANT)")
    cancel.add_argument("--reason", default="", help="why, recorded with the run")
    approve = sub.add_parser("approve", help="approve a run waiting at an await step")
    approve.add_argument("run", help="the run id")
    approve.add_argument("--tenant", default=None, help="the run's tenant (default: ASSAY_TENANT)")
    approve.add_argument("--payload", default="approved", help="the await step's output")
    signal = sub.add_parser("signal", help="send a named signal to a run waiting for it")
    signal.add_argument("run", help="the run id")
    signal.add_argument("name", help="the signal's name")
    signal.add_argument("--tenant", default=None, help="the run's tenant (default: ASSAY_TENANT)")
    signal.add_argument("--payload", default="", help="the await step's output")
    rewind = sub.add_parser("rewind", help="fork a run at an LSN and drive the new branch")
    rewind.add_argument("run", help="the run id")
    rewind.add_argument("--at", type=int, required=True, help="LSN where the new branch departs")
    rewind.add_argument("--branch", type=int, default=None, help="branch to fork (default: live)")
    rewind.add_argument("--tenant", default=None, help="the run's tenant (default: ASSAY_TENANT)")
    rewind.add_argument("--reason", default="", help="why, recorded with the fork")
    branch = sub.add_parser(
        "branch",
        help="fork children of a run after a step, each with deltas; print the lineage tree",
        description=(
            "Fork children of a finished run from the checkpoint after step --at, one per"
            " --delta (prompt:STEP=TEMPLATE, model_params:STEP=max_tokens=N[,timeout_s=S]"
            "[,max_attempts=N], tool_unavailable:TOOL, inject_plan:TEXT) or per item of"
            " --deltas FILE.json; drive each to its end and print which step each child"
            " first differs from its parent at. A contradicted delta refuses the whole command."
        ),
    )
    branch.add_argument("run", help="the run id")
    branch.add_argument("--at", required=True, metavar="STEP", help="the step the children follow")
    branch.add_argument(
        "--delta", action="append", default=[], metavar="SPEC", help="one child's delta (repeat)"
    )
    branch.add_argument("--deltas", type=Path, default=None, metavar="FILE.json", help="children")
    branch.add_argument("--children", type=int, default=None, metavar="K", help="check: K children")
    branch.add_argument("--branch", type=int, default=None, help="branch to fork (default: live)")
    branch.add_argument("--tenant", default=None, help="the run's tenant (default: its own)")
    branch.add_argument("--reason", default="", help="why, recorded with the tree")
    branch.add_argument("--json", action="store_true", help="print the tree as JSON")
    branch.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait for the tree (300)"
    )
    cap = sub.add_parser(
        "capacity", help="the declared GPU capacity and the context ceiling derived from it"
    )
    cap.add_argument("--json", action="store_true", help="print one JSON object")
    results = sub.add_parser("results", help="print RunResults from assay.results as JSON lines")
    results.add_argument("--follow", action="store_true", help="keep waiting for new results")
    results.add_argument("--tenant", default=None, help="only this tenant's results")
    up = sub.add_parser("up", help="start a local distributed deployment, without Docker")
    up.add_argument("--dir", type=Path, default=Path(".assay/stack"), help="state and logs")
    up.add_argument(
        "--replicas",
        default="",
        metavar="STAGE=N ...",
        help="processes per stage, e.g. 'execute=3 tournament=2' (default one each)",
    )
    down = sub.add_parser("down", help="stop what `assay up` started")
    down.add_argument("--dir", type=Path, default=Path(".assay/stack"), help="state and logs")
    down.add_argument(
        "--purge",
        action="store_true",
        help="also drop the database and roles this stack created (only those)",
    )
    grade = sub.add_parser(
        "grade", help="grading: Bradley-Terry fits, SPRT costs, judge health and calibration"
    )
    grade_sub = grade.add_subparsers(dest="grade_command", required=True)
    bt = grade_sub.add_parser(
        "bt",
        help="fit Bradley-Terry-Davidson strengths to pairwise comparisons",
        description=(
            "Read comparisons (rows a,b,winner with winner a, b or draw) or counts (rows"
            " a,b,a_wins,b_wins,draws) from a CSV file, a header row optional, and print"
            " {name: {strength, se, interval}} as JSON, each strength a delta from the"
            " anchor. The tie parameter and the comparison count go to stderr."
        ),
    )
    bt.add_argument("--input", required=True, help="CSV file, or - for stdin")
    bt.add_argument(
        "--anchor",
        action="append",
        default=None,
        metavar="NAME",
        help="pin this player at 0; repeat to pin the mean of several (default: first player)",
    )
    bt.add_argument(
        "--prior-precision",
        type=float,
        default=1.0,
        help="precision of the N(0, 1/x) prior on each strength; 0: maximum likelihood",
    )
    bt.add_argument("--ties", choices=["davidson", "none"], default="davidson", help="draw model")
    bt.add_argument("--level", type=float, default=0.95, help="interval level (default 0.95)")
    sprt = grade_sub.add_parser(
        "sprt",
        help="the sequential test's cost at a true win rate, beside the fixed-n test",
        description=(
            "Simulate the pairwise sequential test at a true win rate and print, as JSON,"
            " the comparisons to a decision (mean and quantiles), the accept and reject"
            " rates, the boundaries, the size of the exact fixed-n binomial test with the"
            " same alpha and beta, and the ratio of the two."
        ),
    )
    sprt.add_argument("--p0", type=float, default=0.5, help="win rate under H0 (default 0.5)")
    sprt.add_argument("--p1", type=float, default=0.7, help="win rate under H1 (default 0.7)")
    sprt.add_argument("--alpha", type=float, default=0.05, help="false-accept rate (0.05)")
    sprt.add_argument("--beta", type=float, default=0.05, help="false-reject rate (0.05)")
    sprt.add_argument(
        "--draw-ceiling", type=float, default=0.5, help="reject above this draw rate (0.5)"
    )
    sprt.add_argument(
        "--min-for-draws", type=int, default=20, help="comparisons before the ceiling applies"
    )
    sprt.add_argument(
        "--simulate-p", type=float, required=True, help="true win rate among decisive verdicts"
    )
    sprt.add_argument("--p-draw", type=float, default=0.0, help="true draw rate (default 0)")
    sprt.add_argument("--reps", type=int, default=10_000, help="simulated tests (10000)")
    sprt.add_argument("--seed", type=int, default=0, help="simulation seed (default 0)")
    sprt.add_argument("--wald", action="store_true", help="Wald's boundaries, not calibrated")
    schemas = sub.add_parser("schemas", help="write the JSON Schemas and AsyncAPI document")
    schemas.add_argument("directory", type=Path, nargs="?", default=Path("schemas"))
    settings = sub.add_parser("settings", help="the settings Assay reads from ASSAY_* variables")
    settings_sub = settings.add_subparsers(dest="settings_command", required=True)
    reference = settings_sub.add_parser(
        "reference", help="write the configuration reference generated from the settings"
    )
    reference.add_argument(
        "--output",
        type=Path,
        default=Path("docs/reference/configuration.md"),
        help="where to write it (default: docs/reference/configuration.md)",
    )
    ladder = sub.add_parser(
        "ladder",
        help="each workflow's versions on the promotion ladder and the held-out gap (JSON)",
    )
    ladder.add_argument("--tenant", default=None, help="one tenant's UUID (default: all)")
    ladder_sub = ladder.add_subparsers(dest="ladder_command")
    ack_drift = ladder_sub.add_parser(
        "ack-drift",
        help="accept a workflow's drifted task mix as the new reference (releases the hold)",
    )
    ack_drift.add_argument("workflow", help="the workflow id")
    ack_drift.add_argument("--tenant", default=None, help="its tenant's UUID, when ambiguous")
    ack_drift.add_argument("--reason", default="", help="why, for the record")
    # `assay proposals` (cli/proposals.py): the slow loop's proposed versions.
    proposals = sub.add_parser(
        "proposals", help="versions the slow loop proposed; approve or reject them (JSON)"
    )
    proposals_sub = proposals.add_subparsers(dest="proposals_command")
    listing = proposals_sub.add_parser("list", help="pending proposals (the default)")
    for where in (proposals, listing):
        where.add_argument("--tenant", default=None, help="one tenant's UUID (default: all)")
        where.add_argument("--all", action="store_true", help="approved and rejected ones too")
    for name, text in (
        ("show", "one proposal whole: definition, rationale, evidence"),
        ("approve", "register the proposed version (it enters shadow)"),
        ("reject", "turn it down; the proposer drafts the next one"),
    ):
        one = proposals_sub.add_parser(name, help=text)
        one.add_argument("proposal", help="the proposal id")
        one.add_argument("--tenant", default=None, help="its tenant's UUID, when ambiguous")
        if name != "show":
            one.add_argument("--reason", default="", help="why, for the record (and the proposer)")
    # `assay grade health` (cli/health.py), `assay grade calibrate` (cli/calibrate.py).
    health = grade_sub.add_parser(
        "health",
        help="judge calls, order consistency, failures and scores per tenant (cli/health.py)",
    )
    health.add_argument("--tenant", default=None, help="one tenant's UUID (default: all)")
    calibrate = grade_sub.add_parser(
        "calibrate",
        help="judge-versus-verifier agreement and order consistency on a calibration set",
    )
    calibrate.add_argument(
        "--set",
        dest="calibration_set",
        type=Path,
        required=True,
        metavar="FILE.jsonl",
        help='one {"task", "passed", "failed"[, "rubric"]} object per line',
    )
    calibrate.add_argument(
        "--judge-from-env",
        action="store_true",
        help="the judge ASSAY_JUDGE_* (or ASSAY_MODEL_*) describe (default: the stub judge)",
    )
    _tenant_parser(sub)
    from assay.cli.fleet import add_parser as add_fleet  # `assay fleet` (cli/fleet.py)

    add_fleet(sub)
    return p


def _tenant_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`assay tenant delete` and `assay tenant status` (cli/tenants.py)."""
    tenant = sub.add_parser("tenant", help="delete a tenant, or see how far its deletion is")
    cmds = tenant.add_subparsers(dest="tenant_command", required=True)
    delete = cmds.add_parser(
        "delete",
        help="every stage deletes the tenant's records, blobs and workspaces (TenantDeleted)",
        description=(
            "Publish a TenantDeleted on assay.tenants: every stage deletes what it holds of"
            " the tenant and keeps a tombstone; the tenant's later tasks are refused. Waits"
            " until every stage is done. An unknown tenant (no workflow of it in ingest) is"
            " an error; a tenant already deleted is a no-op."
        ),
    )
    delete.add_argument("tenant", help="the tenant's UUID")
    delete.add_argument("--reason", default="", help="why, recorded in each tombstone")
    delete.add_argument("--no-wait", action="store_true", help="publish and return at once")
    delete.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait for every stage (300)"
    )
    delete.add_argument("--json", action="store_true", help="print the progress as JSON")
    status = cmds.add_parser("status", help="which stages deleted the tenant")
    status.add_argument("tenant", help="the tenant's UUID")
    status.add_argument("--json", action="store_true", help="print JSON")


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the `assay` script."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.verbose else logging.ERROR,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    _trace(args)
    try:
        code = _run(args, _dispatch(args))
    except AssayError as exc:
        print(f"assay: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(code)


def _run(args: argparse.Namespace, main: Coroutine[Any, Any, int]) -> int:
    """Run `main` to its end: a stage process (`serve`) on uvloop's event loop where it is
    installed, every other command on asyncio's own.

    A stage spends a large share of its CPU turning the event loop (every record fetched,
    handled, committed and shipped is a few callbacks and futures); uvloop turns it in C.
    """
    if args.command == "serve":
        try:
            import uvloop
        except ImportError:  # not on every platform: asyncio's loop does the same work
            pass
        else:
            return uvloop.run(main)
    return asyncio.run(main)


def _trace(args: argparse.Namespace) -> None:
    """Export spans when the OpenTelemetry environment names an OTLP endpoint."""
    from assay.runtime.tracing import EXPORTER_VARIABLES, configure

    if any(os.environ.get(name) for name in EXPORTER_VARIABLES):
        configure(f"assay-{args.stage}" if args.command == "serve" else "assay")


async def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "fleet" and args.fleet_command == "mark":
        from assay.cli.fleet import mark_command  # before anything heavy: agents call it often

        return mark_command(args.edge)
    # Each command imports what it runs, below: `assay grade bt` loads no stage, no
    # store and no message model. The settings are read (and checked) for every one.
    from assay.runtime.settings import AssaySettings

    data_dir: Path = args.data_dir or AssaySettings.from_env().data_dir
    if args.command == "capacity":
        from assay.cli.capacity import capacity

        print(capacity(AssaySettings.from_env(), as_json=args.json))
        return 0
    if args.command == "demo":
        from assay.cli.demo import demo

        overrides = {
            k: getattr(args, k)
            for k in ("p0", "p1", "alpha", "beta", "draw_ceiling")
            if getattr(args, k) is not None
        }
        return await demo(
            data_dir,
            sprt=overrides,
            tasks=args.tasks,
            workflows=args.workflows,
            challengers=args.challengers,
            limit=args.limit,
            progress=not args.no_progress,
            metrics_port=args.metrics_port,
            console=not args.no_console,
            console_port=args.console_port,
        )
    if args.command == "serve-embedded":
        from assay.cli.serve_embedded import serve_embedded_command

        return await serve_embedded_command(data_dir, args.host, args.port)
    if args.command == "console":
        from assay.cli.console import console_command

        return await console_command(data_dir, args.host, args.port)
    if args.command == "runs" and args.runs_command == "list":
        from assay.cli.console import runs_list_command

        keys = ("workflow", "version", "state", "passed", "since", "until", "key", "cursor")
        query = {k: getattr(args, k) for k in (*keys, "limit") if getattr(args, k) is not None}
        return await runs_list_command(data_dir, args.tenant, query, args.json)
    if args.command == "run":
        try:
            task_input = json.loads(args.input)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--input is not JSON: {exc}") from exc
        if not isinstance(task_input, dict):
            raise UsageError("--input must be a JSON object")
        from assay.cli.run import run_once  # the whole pipeline: after the input is checked

        return await run_once(data_dir, args.workflow, task_input)
    if args.command == "rebuild":
        from assay.cli.rebuild import check_postgres, rebuild
        from assay.runtime.settings import AssaySettings

        if args.database_url:
            return await check_postgres(args.database_url, check=args.check, stages=args.stages)
        from_env = AssaySettings.from_env().database.url
        if from_env:
            return await check_postgres(
                from_env, check=args.check, stages=args.stages, source="$ASSAY_DATABASE_URL"
            )
        return await rebuild(data_dir, check=args.check, stages=args.stages)
    if args.command == "runs":
        from assay.cli.runs import show_command

        return await show_command(
            data_dir,
            args.run,
            tenant=args.tenant,
            branch=args.branch,
            all_branches=args.all_branches,
            as_json=args.json,
        )
    if args.command == "branch":
        from assay.cli.branch import branch_command, children_of

        return await branch_command(
            data_dir,
            args.run,
            at=args.at,
            children=children_of(args.delta, args.deltas, args.children),
            branch=args.branch,
            tenant=args.tenant,
            reason=args.reason,
            as_json=args.json,
            timeout_s=args.timeout,
        )
    if args.command in (
        "serve",
        "db",
        "topics",
        "register",
        "submit",
        "results",
        "cancel",
        "rewind",
        "approve",
        "signal",
    ):
        from assay.cli import distributed as d

        if args.command == "serve":
            return await d.serve_command(args.stage)
        if args.command == "db":
            return await d.provision_command()
        if args.command == "topics":
            return await d.topics_command()
        if args.command == "register":
            return await d.register_command(
                args.workflow, args.tenant or d.default_tenant(), args.rewrite, args.parents
            )
        if args.command == "submit":
            from assay.cli.candidates import matrix_of

            matrix = matrix_of(args.candidates, args.matrix, args.control)
            return await d.submit_command(
                args.file, args.tenant, args.workflow, matrix, args.wait, args.wait_s
            )
        if args.command in ("approve", "signal"):
            name = "approval" if args.command == "approve" else args.name
            return await d.signal_command(
                args.run, args.tenant or d.default_tenant(), name, args.payload
            )
        if args.command == "rewind":
            return await d.rewind_command(
                args.run, args.tenant or d.default_tenant(), args.at, args.branch, args.reason
            )
        if args.command == "cancel" and args.rollout:
            return await d.cancel_rollout_command(
                args.run, args.tenant or d.default_tenant(), args.reason
            )
        if args.command == "cancel":
            return await d.cancel_command(args.run, args.tenant or d.default_tenant(), args.reason)
        return await d.results_command(args.follow, args.tenant)
    if args.command in ("up", "down"):
        from assay.devstack import stack

        if args.command == "up":
            from assay.devstack.deployment import parse_replicas

            return await stack.up(args.dir, parse_replicas(args.replicas))
        return await stack.down(args.dir, purge_objects=args.purge)
    if args.command == "grade" and args.grade_command in ("bt", "sprt"):
        from assay.cli import grade

        if args.grade_command == "bt":
            return grade.bt_command(
                args.input,
                anchors=args.anchor,
                prior_precision=args.prior_precision,
                ties=args.ties,
                level=args.level,
            )
        return grade.sprt_command(
            policy_fields={
                "p0": args.p0,
                "p1": args.p1,
                "alpha": args.alpha,
                "beta": args.beta,
                "draw_ceiling": args.draw_ceiling,
                "min_for_draws": args.min_for_draws,
                "calibrated": not args.wald,
            },
            win_rate=args.simulate_p,
            reps=args.reps,
            seed=args.seed,
            draw_rate=args.p_draw,
        )
    if args.command == "schemas":
        from assay.cli.schemas import write

        for path in write(args.directory):
            print(path)
        return 0
    if args.command == "settings":
        from assay.runtime.config_reference import write as write_reference

        print(write_reference(args.output))
        return 0
    if args.command == "ladder":
        from assay.cli.ladder import ladder_command
        from assay.cli.logs import tenant_arg

        who = tenant_arg(args.tenant) if args.tenant else None
        if args.ladder_command == "ack-drift":
            from assay.cli.drift import ack_drift_command

            return await ack_drift_command(data_dir, args.workflow, who, args.reason)
        return await ladder_command(data_dir, who)
    if args.command == "proposals":
        from assay.cli import proposals as pr
        from assay.cli.logs import tenant_arg

        who = tenant_arg(args.tenant) if args.tenant else None
        match args.proposals_command:
            case None | "list":
                return await pr.list_command(data_dir, who, args.all)
            case "show":
                return await pr.show_command(data_dir, args.proposal, who)
            case _:
                approve = args.proposals_command == "approve"
                return await pr.review_command(data_dir, args.proposal, who, approve, args.reason)
    if args.command == "grade" and args.grade_command == "health":
        from assay.cli.health import health_command
        from assay.cli.logs import tenant_arg

        return await health_command(data_dir, tenant_arg(args.tenant) if args.tenant else None)
    if args.command == "grade" and args.grade_command == "calibrate":
        from assay.cli.calibrate import calibrate_command

        return await calibrate_command(args.calibration_set, judge_from_env=args.judge_from_env)
    if args.command == "tenant":
        from assay.cli import tenants

        if args.tenant_command == "status":
            return await tenants.status_command(data_dir, args.tenant, as_json=args.json)
        return await tenants.delete_command(
            data_dir,
            args.tenant,
            reason=args.reason,
            wait=not args.no_wait,
            timeout_s=args.timeout,
            as_json=args.json,
        )
    if args.command == "fleet":
        from assay.cli.fleet_commands import dispatch as fleet_dispatch

        return await fleet_dispatch(args, data_dir)
    raise UsageError(f"unknown command {args.command}")
