"""`assay branch RUN --at STEP --delta SPEC ...`: fork children of a finished run from the
checkpoint after one of its steps, each with declared deltas, and print the lineage tree.

One `--delta` per child, each one delta:

    prompt:STEP=TEMPLATE                      a different prompt template for a model step
    model_params:STEP=max_tokens=N,timeout_s=S,max_attempts=N   (any of them)
    tool_unavailable:TOOL                     calling TOOL fails the attempt
    inject_plan:TEXT                          TEXT goes above every later model prompt

or `--deltas FILE.json`: a JSON list with one item per child, each
`{"deltas": [{"kind": ..., ...}, ...], "label": "..."}` (several deltas a child).
`--children K`, when given, must be the number of children.

The command is a `BranchRun` on `assay.run-commands`, handled by the execute stage:

- **Embedded** (no `ASSAY_KAFKA_BOOTSTRAP`): the pipeline runs in this process on
  the data directory, as `assay demo` does, until the tree is recorded — or the
  stage refused the command, whose reason is then the error (exit 2).
- **Distributed**: the command is produced to Kafka; with `ASSAY_DATABASE_URL` set
  the tree is awaited in the execute schema (read only), else the command id is
  printed and `assay runs show RUN` shows the tree once it is recorded. A refused
  command is on `assay.dlq.execute` with its reason.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from assay.bus.topics import RUN_COMMANDS, producer_entry
from assay.cli.logs import postgres_log, tenant_arg
from assay.engine.events import WORK_EVENTS, BranchTreeRecorded, commands_stream, fold_work
from assay.kernel.errors import AssayError, Refused
from assay.kernel.ids import RunId, StepId, TenantId, is_run_id
from assay.kernel.schema import one_line
from assay.messages import BranchChild, BranchRun, open_envelope
from assay.messages.branching import AnyDelta, BranchDelta
from assay.record.events import BranchKey
from assay.record.state import StateKey
from assay.runtime.settings import AssaySettings
from assay.store.ports import EventLog, OutboxEntry

KINDS = ("prompt", "model_params", "tool_unavailable", "inject_plan")
_DELTA: TypeAdapter[AnyDelta] = TypeAdapter(BranchDelta)
_CHILDREN: TypeAdapter[list[BranchChild]] = TypeAdapter(list[BranchChild])


class BranchRefused(AssayError):
    """The execute stage refused the branch command; the reason says why."""


def parse_delta(spec: str) -> AnyDelta:
    """One `--delta` argument as a delta.

    Raises:
        AssayError: an unknown kind, a missing target or value, or a value out of range.
    """
    kind, sep, rest = spec.partition(":")
    if not sep or kind not in KINDS:
        raise AssayError(f"--delta {spec!r}: start with one of {', '.join(KINDS)} and a colon")
    doc: dict[str, Any] = {"kind": kind}
    if kind in ("prompt", "model_params"):
        step, eq, value = rest.partition("=")
        if not step or not eq or not value:
            raise AssayError(f"--delta {spec!r}: write {kind}:STEP=VALUE")
        doc["step"] = step
        if kind == "prompt":
            doc["prompt"] = value
        else:
            for pair in value.split(","):
                name, eq, number = pair.partition("=")
                if not eq or name not in ("max_tokens", "timeout_s", "max_attempts"):
                    raise AssayError(
                        f"--delta {spec!r}: parameters are max_tokens=N, timeout_s=S, "
                        "max_attempts=N, separated by commas"
                    )
                doc[name] = number
    elif kind == "tool_unavailable":
        doc["tool"] = rest
    else:
        doc["plan"] = rest
    try:
        return _DELTA.validate_python(doc)
    except ValidationError as exc:
        raise AssayError(f"--delta {spec!r}: {one_line(exc)}") from exc


def read_children(path: Path) -> list[BranchChild]:
    """The children of a `--deltas FILE.json`.

    Raises:
        AssayError: the file cannot be read, is not JSON, or does not describe children.
    """
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise AssayError(f"--deltas {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise AssayError(f"--deltas {path}: not JSON: {exc}") from exc
    try:
        return _CHILDREN.validate_python(doc)
    except ValidationError as exc:
        raise AssayError(f"--deltas {path}: {one_line(exc)}") from exc


def children_of(deltas: Sequence[str], file: Path | None, count: int | None) -> list[BranchChild]:
    """The children the arguments describe.

    Raises:
        AssayError: none, both `--delta` and `--deltas`, or not `count` of them.
    """
    if deltas and file is not None:
        raise AssayError("give --delta (one per child) or --deltas FILE.json, not both")
    children = (
        read_children(file)
        if file is not None
        else [BranchChild(deltas=[parse_delta(d)]) for d in deltas]
    )
    if not children:
        raise AssayError("no children: give --delta once per child, or --deltas FILE.json")
    if count is not None and count != len(children):
        raise AssayError(f"--children {count}, but {len(children)} children have deltas")
    return children


async def branch_command(
    data_dir: Path,
    run: str,
    *,
    at: str,
    children: list[BranchChild],
    branch: int | None,
    tenant: str | None,
    reason: str,
    as_json: bool,
    timeout_s: float,
) -> int:
    """Branch `run` and print its tree (see the module's docstring).

    Raises:
        AssayError: bad input, an unknown run, a refused command, or no tree in time.
    """
    if not is_run_id(run):
        raise AssayError(f"not a run id: {run!r}")
    if branch is not None and branch < 0:
        raise AssayError(f"--branch must be 0 or more, not {branch}")
    settings = AssaySettings.from_env()
    if settings.kafka.bootstrap:
        found = await _distributed(settings, run, at, children, branch, tenant, reason, timeout_s)
    else:
        found = await _embedded(data_dir, run, at, children, branch, tenant, reason, timeout_s)
    if found is None:
        return 0
    print(_render(*found, as_json=as_json), end="")
    return 0


def _command(
    run: str, at: str, children: list[BranchChild], branch: int | None, tenant: TenantId, why: str
) -> tuple[OutboxEntry, str]:
    try:
        msg = BranchRun(
            tenant=tenant,
            run_id=RunId(run),
            at_step=StepId(at),
            branch=branch,
            children=children,
            reason=why,
        )
    except ValidationError as exc:
        raise AssayError(f"invalid branch command: {one_line(exc)}") from exc
    entry = producer_entry(RUN_COMMANDS, msg, tenant, f"branch:{run}:{uuid.uuid4()}")
    return entry, open_envelope(entry.value).id


async def _tree(
    log: EventLog, tenant: TenantId, run: str, command: str
) -> BranchTreeRecorded | None:
    """The tree the command recorded, once it is."""
    if await log.get(StateKey(tenant, "branching", f"{run}/{command}")) is None:
        return None
    for r in await log.read(BranchKey.main(tenant, commands_stream(run))):
        if isinstance(r.event, BranchTreeRecorded) and r.event.tree.command == command:
            return r.event
    return None


async def _embedded(
    data_dir: Path,
    run: str,
    at: str,
    children: list[BranchChild],
    branch: int | None,
    tenant: str | None,
    reason: str,
    timeout_s: float,
) -> tuple[BranchTreeRecorded, TenantId]:
    from assay.runtime.embedded import Embedded

    if not (data_dir / "execute.sqlite").is_file():
        raise AssayError(f"no run {run}: no execute log in {data_dir}")
    async with Embedded(data_dir) as rt:
        log = rt.logs["execute"]
        who = await _tenant_of(log, run, tenant_arg(tenant) if tenant else None, str(data_dir))
        entry, command = _command(run, at, children, branch, who, reason)
        try:
            found = await rt.command(
                "execute", entry, lambda: _tree(log, who, run, command), timeout_s
            )
        except Refused as exc:
            raise BranchRefused(f"branch refused: {exc.reason}") from exc
        except TimeoutError as exc:
            raise AssayError(f"no tree for run {run} within {timeout_s:g}s") from exc
        return found, who


async def _tenant_of(log: EventLog, run: str, tenant: TenantId | None, where: str) -> TenantId:
    keys = await log.branches(run, tenant)
    tenants = {k.tenant for k in keys}
    if not tenants:
        whose = f" of tenant {tenant}" if tenant is not None else ""
        raise AssayError(f"no run {run}{whose} in {where}")
    if len(tenants) > 1:
        raise AssayError(f"run {run} exists under {len(tenants)} tenants: name one with --tenant")
    return next(iter(tenants))


async def _distributed(
    settings: AssaySettings,
    run: str,
    at: str,
    children: list[BranchChild],
    branch: int | None,
    tenant: str | None,
    reason: str,
    timeout_s: float,
) -> tuple[BranchTreeRecorded, TenantId] | None:
    from assay.cli.distributed import default_tenant, produce

    who = tenant_arg(tenant or default_tenant())
    entry, command = _command(run, at, children, branch, who, reason)
    await produce([entry])
    if not settings.database.url:
        print(f"asked to branch run {run} after step {at} (command {command});")
        print(f"`assay runs show {run}` shows the tree once it is recorded")
        return None
    async with postgres_log(settings.database.url, "execute", WORK_EVENTS, fold_work) as log:
        deadline = time.monotonic() + timeout_s
        while (found := await _tree(log, who, run, command)) is None:
            if time.monotonic() > deadline:
                raise AssayError(
                    f"no tree for run {run} within {timeout_s:g}s (command {command}); "
                    "a refused command is on assay.dlq.execute with its reason"
                )
            await asyncio.sleep(0.5)
        return found, who


def _render(recorded: BranchTreeRecorded, tenant: TenantId, *, as_json: bool) -> str:
    tree = recorded.tree
    if as_json:
        doc = {"tree_ref": recorded.tree_ref, "tree": tree.model_dump(mode="json")}
        return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
    b = tree.boundary
    lines = [
        f"branched run {tree.run_id} after step {b.step} (branch {b.branch}, lsn {b.at}): "
        f"{len(tree.children)} children",
        f"  tenant {tenant}  tree {recorded.tree_ref}",
        f"  parent {tree.parent.status}"
        + (f" at step {tree.parent.failed_step}" if tree.parent.failed_step else ""),
    ]
    for c in tree.children:
        deltas = " + ".join(d.describe() for d in c.deltas)
        end = c.outcome.status + (
            f" at step {c.outcome.failed_step}" if c.outcome.failed_step else ""
        )
        where = (
            f"diverged at {c.diverged_at.step}: {c.diverged_at.why}"
            if c.diverged_at
            else "diverged nowhere"
        )
        label = f'  "{c.label}"' if c.label else ""
        lines.append(f"  child {c.child}  branch {c.branch}  {deltas}{label}  {end}  {where}")
    stages = "; ".join(
        f"{a.step or 'none'}: {', '.join(str(n) for n in a.children)}" for a in tree.attribution
    )
    lines.append(f"  attribution {stages}")
    return "\n".join(lines) + "\n"
