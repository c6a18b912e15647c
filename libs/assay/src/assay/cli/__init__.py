"""The `assay` command line. Errors are one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

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

    demo = sub.add_parser("demo", help="v1 current, v2 challenger, example tasks, SPRT decision")
    demo.add_argument("--tasks", type=Path, default=None, help="JSONL tasks (default: examples)")
    demo.add_argument(
        "--workflows",
        type=Path,
        nargs=2,
        default=None,
        metavar=("CURRENT", "CHALLENGER"),
        help="workflow files",
    )
    demo.add_argument("--limit", type=int, default=None, help="submit only the first N tasks")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
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

    rebuild = sub.add_parser("rebuild", help="re-fold every stage's derived state from its log")
    rebuild.add_argument(
        "--check",
        action="store_true",
        help="compare byte for byte and change nothing; exit 1 on a difference",
    )
    schemas = sub.add_parser("schemas", help="write the JSON Schemas and AsyncAPI document")
    schemas.add_argument("directory", type=Path, nargs="?", default=Path("schemas"))
    return p


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the `assay` script."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.verbose else logging.ERROR,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        code = asyncio.run(_dispatch(args))
    except AssayError as exc:
        print(f"assay: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(code)


async def _dispatch(args: argparse.Namespace) -> int:
    from assay.runtime.embedded import default_data_dir

    data_dir: Path = args.data_dir or default_data_dir()
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
            limit=args.limit,
            progress=not args.no_progress,
        )
    if args.command == "run":
        from assay.cli.run import run_once

        try:
            task_input = json.loads(args.input)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--input is not JSON: {exc}") from exc
        if not isinstance(task_input, dict):
            raise UsageError("--input must be a JSON object")
        return await run_once(data_dir, args.workflow, task_input)
    if args.command == "rebuild":
        from assay.cli.rebuild import rebuild

        return await rebuild(data_dir, check=args.check)
    if args.command == "schemas":
        from assay.cli.schemas import write

        for path in write(args.directory):
            print(path)
        return 0
    raise UsageError(f"unknown command {args.command}")
