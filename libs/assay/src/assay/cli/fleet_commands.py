"""`assay fleet ...` commands: read files, call the pure functions of `assay.fleet`, print.

Bad input is a `FleetError`: one line on stderr naming the place, exit code 2, nothing
written. `validate` lists every problem, one per line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from assay.fleet.errors import FleetError
from assay.fleet.metrics import MetricsSummary
from assay.fleet.simulate import Gates, Policy, simulate
from assay.fleet.trace import Trace, WaitKind
from assay.fleet.validate import TraceInvalid, parse_trace

METRICS_SUFFIX = ".metrics.jsonl"
"""The recorder's sibling metrics files, which are not traces."""


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
    return _parse(trace_paths(paths))


def trace_paths(paths: list[Path]) -> list[Path]:
    """The trace files `paths` name: files as given, directories' `*.jsonl` but metrics.

    Raises:
        FleetError: a path does not exist, or a directory holds no trace.
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
    return files


def _parse(files: list[Path]) -> list[Trace]:
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


def read_metrics(files: list[Path]) -> list[MetricsSummary | None]:
    """Each trace's sibling recorder metrics, summarised (None where there is none).

    Raises:
        TraceInvalid: a metrics file breaks a rule.
    """
    from assay.fleet.metrics import parse_metrics

    out: list[MetricsSummary | None] = []
    for f in files:
        sibling = f.with_name(f.name.removesuffix(".jsonl") + METRICS_SUFFIX)
        out.append(parse_metrics(sibling.read_text(), str(sibling)) if sibling.is_file() else None)
    return out


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
            found = trace_paths(args.paths)
            report = analyze(_parse(found), policy, gates, minimums, read_metrics(found))
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
            recording = Recording(
                output=args.output,
                name=args.name,
                workflow_version=args.workflow_version,
                cpu_cores=args.cpu_cores,
                memory_gib=args.memory_gib,
                sample_interval_s=args.sample_interval,
            )
            try:
                status = record(recording, command)
            except TraceInvalid as bad:
                for issue in bad.issues:
                    print(f"assay: error: {issue}", file=sys.stderr)
                return 2
            return (
                128 - status if status < 0 else status
            )  # killed by signal N: 128 + N, as shells say
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
