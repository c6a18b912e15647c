"""`assay fleet ...`: the parser of idle-suspension analysis (DESIGN §16).

Building it imports nothing of `assay.fleet`, so every other `assay` command starts as
fast as before; the commands themselves are in `fleet_commands.py`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

WAIT_KINDS = ("model", "tool", "human")
"""`assay.fleet.WaitKind`'s values, named here so that building the parser imports nothing."""


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


MARKS = [f"{k}-wait-{e}" for k in WAIT_KINDS for e in ("started", "finished")]


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


def mark_command(edge: str) -> int:
    """`assay fleet mark KIND-wait-EDGE`: one mark, light enough to call around every wait."""
    from assay.fleet.markers import mark

    kind, _, which = edge.partition("-wait-")
    mark(kind, "started" if which == "started" else "finished")
    return 0
