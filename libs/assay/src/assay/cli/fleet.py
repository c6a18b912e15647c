"""`assay fleet ...`: idle-suspension analysis on lifecycle traces (DESIGN §16).

The parser is built here and hooked under `assay fleet`; each command reads its files,
calls the pure functions of `assay.fleet`, and prints. Bad input is a `FleetError`: one
line on stderr naming the place, exit code 2, nothing written. `validate` lists every
problem, one per line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from assay.fleet.errors import FleetError
from assay.fleet.trace import Trace
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
