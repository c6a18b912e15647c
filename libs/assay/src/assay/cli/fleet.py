"""`assay fleet ...`: idle-suspension analysis on lifecycle traces (DESIGN §16).

The parser is built here and hooked under `assay fleet`; each command reads its files,
calls the pure functions of `assay.fleet`, and prints. Bad input is a `FleetError`: one
line on stderr naming the place, exit code 2, nothing written. `validate` lists every
problem, one per line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from assay.fleet.errors import FleetError
from assay.fleet.simulate import Gates, Policy, simulate
from assay.fleet.trace import Trace, WaitKind
from assay.fleet.validate import TraceInvalid, parse_trace

METRICS_SUFFIX = ".metrics.jsonl"
"""The recorder's sibling metrics files, which are not traces."""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `assay fleet` and its commands."""
    fleet = sub.add_parser(
        "fleet",
        help="idle-suspension analysis on lifecycle traces of recorded runs",
        description=(
            "Export lifecycle traces from the execute log, validate them, and simulate"
            " always-on sandboxes against idle suspension behind acceptance gates."
        ),
    )
    cmds = fleet.add_subparsers(dest="fleet_command", required=True)

    validate = cmds.add_parser(
        "validate", help="check traces strictly; every problem by file, line and rule"
    )
    validate.add_argument("paths", type=Path, nargs="+", metavar="PATH", help="files or dirs")

    export = cmds.add_parser(
        "export",
        help="one trace per finished run, from the execute log",
        description=(
            "Derive a lifecycle trace for each selected, finished run from the execute log:"
            " the data directory's, or Postgres's given --database-url or ASSAY_DATABASE_URL."
            " Model calls are model waits, tools outside the sandbox tool waits, await steps"
            " human waits, sandboxed tools busy time."
        ),
    )
    export.add_argument("--output", type=Path, required=True, help="directory for the traces")
    export.add_argument("--database-url", default=None, metavar="URL", help="read Postgres")
    export.add_argument("--tenant", default=None, help="only this tenant's runs (UUID)")
    export.add_argument("--workflow", default=None, help="only this workflow id")
    export.add_argument("--version", default=None, help="only this version (or its prefix)")
    export.add_argument("--since", default=None, metavar="TIME", help="started at or after")
    export.add_argument("--until", default=None, metavar="TIME", help="started before")
    export.add_argument("--cpu-cores", type=float, default=1.0, help="sandbox cores (1)")
    export.add_argument(
        "--memory-gib",
        type=float,
        default=None,
        help="sandbox memory (default: ASSAY_SANDBOX_MEMORY_BYTES, in GiB)",
    )
    export.add_argument(
        "--sandboxed-tool",
        action="append",
        default=None,
        metavar="NAME",
        help="a tool that runs in the sandbox (repeat; default: command, write_file)",
    )

    simulate = cmds.add_parser(
        "simulate",
        help="always-on sandboxes against idle suspension, behind the acceptance gate",
        description=(
            "Simulate traces with sandboxes always on and with suspension after --idle-after"
            " seconds idle, charging checkpoint and resume costs and the latency a resume adds;"
            " print resource-time both ways, the saving and the completion-time overhead as"
            " JSON. Exit 0 when the gate passes, 1 when it does not."
        ),
    )
    simulate.add_argument("paths", type=Path, nargs="+", metavar="PATH", help="files or dirs")
    policy_args(simulate)
    gate_args(simulate)
    pretty_arg(simulate)

    analyze = cmds.add_parser(
        "analyze",
        help="per workload class: p50/p95/p99 waits, saving, overhead and a gate each",
        description=(
            "Group traces by workload class (workflow id and version); print each class's"
            " wait percentiles by kind, its simulation and its own gate as JSON. Exit 0 only"
            " when enough classes hold enough traces and every class passes."
        ),
    )
    analyze.add_argument("paths", type=Path, nargs="+", metavar="DIR", help="traces")
    policy_args(analyze)
    gate_args(analyze)
    minimum_args(analyze)
    pretty_arg(analyze)

    generate = cmds.add_parser(
        "generate",
        help="seeded synthetic traces (same seed, same bytes); for testing, not evidence",
    )
    generate.add_argument("--output", type=Path, required=True, help="directory (new files)")
    generate.add_argument("--seed", type=int, default=0, help="random seed (0)")
    generate.add_argument("--traces-per-class", type=int, default=30, metavar="N", help="(30)")
    generate.add_argument(
        "--class",
        dest="classes",
        action="append",
        default=None,
        metavar="NAME",
        help="coding-agent or review-agent (repeat; default: both)",
    )

    experiment = cmds.add_parser(
        "experiment",
        help="run a manifest that pins traces, baseline, policy, gates and evaluator",
        description=(
            "Validate the manifest strictly, check that its trace directory hashes to the"
            " pinned content hash, and print the report (byte-identical for the same"
            " manifest). Exit 0 when every gate passes, 1 when one fails."
        ),
    )
    experiment.add_argument("manifest", type=Path, help="the manifest (JSON)")
    digest = cmds.add_parser("hash", help="the content hash of a trace directory, for a manifest")
    digest.add_argument("directory", type=Path, help="the traces")

    record = cmds.add_parser(
        "record",
        help="run a command, observe it, and write its trace and sampled metrics",
        description=(
            "Run CMD with its output passed through unread; sample its process tree's CPU,"
            " RSS and process count from /proc into OUTPUT's sibling .metrics.jsonl; turn the"
            " wait marks it makes (assay fleet mark, assay.fleet.markers.wait) into the trace"
            " OUTPUT. Files are owner-only and never overwritten. Exits with CMD's status."
        ),
    )
    record.add_argument("--output", type=Path, required=True, help="the trace (*.jsonl)")
    record.add_argument("--name", required=True, help="the workload class's name")
    record.add_argument(
        "--workflow-version", default="unversioned", help="the class's version (unversioned)"
    )
    record.add_argument("--cpu-cores", type=float, required=True, help="declared cores")
    record.add_argument("--memory-gib", type=float, required=True, help="declared memory")
    record.add_argument(
        "--sample-interval", type=float, default=1.0, metavar="S", help="seconds (1)"
    )
    record.add_argument("argv", nargs=argparse.REMAINDER, help="-- CMD ARG...")
    mark = cmds.add_parser(
        "mark",
        help="mark a wait's start or end inside `assay fleet record` (nothing outside it)",
    )
    mark.add_argument("edge", choices=MARKS, help="what happened")

    sweep = cmds.add_parser(
        "sweep",
        help="a range of --idle-after values per class: the frontier of saving and overhead",
        description=(
            "Simulate each workload class at --idle-after values from --from to --to by"
            " --step (seconds), checkpoint and resume costs fixed; print a table with the"
            " frontier marked (or --json), and write the plot to --svg FILE."
        ),
    )
    sweep.add_argument("paths", type=Path, nargs="+", metavar="PATH", help="files or dirs")
    sweep.add_argument("--from", dest="start", type=float, default=0.0, metavar="S", help="(0)")
    sweep.add_argument("--to", dest="stop", type=float, default=120.0, metavar="S", help="(120)")
    sweep.add_argument("--step", type=float, default=10.0, metavar="S", help="(10)")
    policy_args(sweep)
    gate_args(sweep)
    sweep.add_argument("--svg", type=Path, default=None, metavar="FILE", help="write the plot")
    sweep.add_argument("--json", action="store_true", help="print JSON, not the table")

    plan = cmds.add_parser(
        "plan",
        help="observe-only decision log: would_suspend / would_resume with times and reasons",
    )
    plan.add_argument("trace", type=Path, help="one trace file")
    policy_args(plan)
    pretty_arg(plan)


MARKS = [f"{k.value}-wait-{e}" for k in WaitKind for e in ("started", "finished")]


def policy_args(p: argparse.ArgumentParser) -> None:
    """The suspension policy's flags."""
    p.add_argument("--idle-after", type=float, default=30.0, metavar="S", help="idle seconds (30)")
    p.add_argument(
        "--checkpoint-s", type=float, default=0.0, metavar="S", help="checkpoint cost (0)"
    )
    p.add_argument("--resume-s", type=float, default=0.0, metavar="S", help="resume cost (0)")
    p.add_argument(
        "--kinds",
        default="model,tool,human",
        metavar="K,K",
        help="wait kinds suspended (model,tool,human)",
    )


def gate_args(p: argparse.ArgumentParser) -> None:
    """The acceptance gate's flags; the defaults are the seed's."""
    p.add_argument("--min-cpu-saving", type=float, default=0.20, help="fraction (0.20)")
    p.add_argument("--min-memory-saving", type=float, default=0.20, help="fraction (0.20)")
    p.add_argument("--max-overhead", type=float, default=0.05, help="fraction (0.05)")


def minimum_args(p: argparse.ArgumentParser) -> None:
    """How much evidence a verdict needs."""
    p.add_argument("--minimum-traces-per-class", type=int, default=30, metavar="N", help="(30)")
    p.add_argument("--minimum-workload-classes", type=int, default=2, metavar="N", help="(2)")


def pretty_arg(p: argparse.ArgumentParser) -> None:
    """`--pretty`: indented JSON."""
    p.add_argument("--pretty", action="store_true", help="indent the JSON")


def policy_of(args: argparse.Namespace) -> Policy:
    """The policy the flags describe.

    Raises:
        FleetError: a negative time or an unknown kind.
    """
    kinds = []
    for name in args.kinds.split(","):
        try:
            kinds.append(WaitKind(name.strip()))
        except ValueError as exc:
            raise FleetError(f"--kinds: unknown wait kind {name!r} (model, tool, human)") from exc
    return Policy.from_seconds(args.idle_after, args.checkpoint_s, args.resume_s, kinds)


def gates_of(args: argparse.Namespace) -> Gates:
    """The gate the flags describe."""
    return Gates(args.min_cpu_saving, args.min_memory_saving, args.max_overhead)


def dump(doc: object, pretty: bool) -> str:
    """JSON with sorted keys: the same input prints the same bytes."""
    return json.dumps(doc, sort_keys=True, indent=2 if pretty else None)


def trace_files(directory: Path) -> dict[str, bytes]:
    """The traces under `directory`: relative POSIX path -> bytes.

    Raises:
        FleetError: it is not a directory, or holds no trace.
    """
    if not directory.is_dir():
        raise FleetError(f"{directory}: not a directory")
    found = {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*.jsonl"))
        if not p.name.endswith(METRICS_SUFFIX)
    }
    if not found:
        raise FleetError(f"{directory}: no *.jsonl traces")
    return found


def read_traces(paths: list[Path]) -> list[Trace]:
    """Every trace in `paths` (files, or directories of `*.jsonl` but metrics files).

    Raises:
        TraceInvalid: a trace breaks a rule (every problem of every file is listed).
        FleetError: a path does not exist, or names no trace.
    """
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(p for p in path.rglob("*.jsonl") if not p.name.endswith(METRICS_SUFFIX))
            if not found:
                raise FleetError(f"{path}: no *.jsonl traces")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise FleetError(f"{path}: no such file or directory")
    traces, issues = [], []
    for f in files:
        try:
            traces.append(parse_trace(f.read_text(encoding="utf-8"), str(f)))
        except TraceInvalid as bad:
            issues.extend(bad.issues)
        except (OSError, UnicodeDecodeError) as exc:
            raise FleetError(f"{f}: cannot read: {exc}") from exc
    if issues:
        raise TraceInvalid(issues)
    return traces


async def dispatch(args: argparse.Namespace, data_dir: Path) -> int:
    """Run the `assay fleet` command `args` names."""
    match args.fleet_command:
        case "validate":
            try:
                traces = read_traces(args.paths)
            except TraceInvalid as bad:
                for issue in bad.issues:
                    print(f"assay: error: {issue}", file=sys.stderr)
                return 2
            print(f"{len(traces)} valid trace(s)")
            return 0
        case "simulate":
            policy, gates = policy_of(args), gates_of(args)
            result = simulate(read_traces(args.paths), policy)
            reasons = result.verdict(gates)
            doc = {
                "policy": policy.to_json(),
                "gates": gates.to_json(),
                "result": result.to_json(),
                "gate": {"passed": not reasons, "reasons": reasons},
            }
            print(dump(doc, args.pretty))
            return 0 if not reasons else 1
        case "analyze":
            from assay.fleet.analyze import Minimums, analyze

            minimums = Minimums(args.minimum_traces_per_class, args.minimum_workload_classes)
            policy, gates = policy_of(args), gates_of(args)
            report = analyze(read_traces(args.paths), policy, gates, minimums)
            print(dump(report, args.pretty))
            return 0 if report["passed"] else 1
        case "generate":
            from assay.cli.fleet_export import write_new
            from assay.fleet.generate import generate

            made = generate(args.seed, args.traces_per_class, args.classes)
            write_new(args.output, {f"{t.header.run}.jsonl": t.to_jsonl() for t in made})
            print(dump({"directory": str(args.output), "written": len(made)}, False))
            return 0
        case "hash":
            from assay.fleet.experiment import trace_set_hash

            print(trace_set_hash(trace_files(args.directory)))
            return 0
        case "experiment":
            from assay.fleet.experiment import parse_manifest, run_experiment, trace_set_hash

            try:
                text = args.manifest.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise FleetError(f"{args.manifest}: cannot read: {exc}") from exc
            manifest = parse_manifest(text, str(args.manifest))
            where = args.manifest.parent / manifest.traces.directory
            files = trace_files(where)
            traces = read_traces([where / name for name in files])
            report = run_experiment(manifest, traces, trace_set_hash(files))
            print(dump(report, True))
            return 0 if report["analysis"]["passed"] else 1
        case "record":
            from assay.fleet.recorder import Recording, record

            if not args.output.name.endswith(".jsonl") or args.output.name.endswith(METRICS_SUFFIX):
                raise FleetError("--output must name a *.jsonl trace (not *.metrics.jsonl)")
            command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
            try:
                return (
                    record(
                        Recording(
                            output=args.output,
                            name=args.name,
                            workflow_version=args.workflow_version,
                            cpu_cores=args.cpu_cores,
                            memory_gib=args.memory_gib,
                            sample_interval_s=args.sample_interval,
                        ),
                        command,
                    )
                    & 0xFF
                )
            except TraceInvalid as bad:
                for issue in bad.issues:
                    print(f"assay: error: {issue}", file=sys.stderr)
                return 2
        case "mark":
            from assay.fleet.markers import mark

            kind, _, edge = args.edge.partition("-wait-")
            mark(kind, "started" if edge == "started" else "finished")
            return 0
        case "sweep":
            from assay.cli.fleet_export import create_new
            from assay.fleet.sweep import idle_values, render_svg, render_table, sweep

            values = idle_values(args.start, args.stop, args.step)
            policy, gates = policy_of(args), gates_of(args)
            traces = read_traces(args.paths)
            if args.svg is not None and args.svg.exists():
                raise FleetError(f"{args.svg} exists: refusing to overwrite it")
            points = sweep(traces, policy, values, gates)
            if args.svg is not None:
                create_new(args.svg, render_svg(points, gates))
            if args.json:
                per_class = {k: [p.to_json() for p in ps] for k, ps in points.items()}
                print(dump({"policy": policy.to_json(), "classes": per_class}, True))
            else:
                print(render_table(points), end="")
            return 0
        case "plan":
            from assay.fleet.plan import plan

            policy = policy_of(args)
            trace = read_traces([args.trace])[0]
            for decision in plan(trace, policy):
                print(dump(decision.to_json(), args.pretty))
            return 0
        case "export":
            from assay.cli.fleet_export import export_command
            from assay.fleet.export import SANDBOXED_TOOLS
            from assay.runtime.settings import AssaySettings

            settings = AssaySettings.from_env()
            memory = args.memory_gib
            if memory is None:
                memory = settings.sandbox.memory_bytes / (1 << 30)
            return await export_command(
                data_dir,
                args.database_url or settings.database.url,
                args.output,
                tenant=args.tenant,
                workflow=args.workflow,
                version=args.version,
                since=args.since,
                until=args.until,
                cpu_cores=args.cpu_cores,
                memory_gib=memory,
                sandboxed=frozenset(args.sandboxed_tool or SANDBOXED_TOOLS),
            )
    raise FleetError(f"unknown fleet command {args.fleet_command}")
