"""`assay runs show RUN`: a run's branches, attempts and intents, from the execute log alone.

Where the log is: with `ASSAY_DATABASE_URL` set, the `execute` schema in Postgres
(read as it is: nothing is migrated or written); otherwise the data directory's
`execute.sqlite`, then `local-runs.sqlite` (the runs of `assay run`). Nothing is
read from derived state or blobs; the view is `assay.engine.episode_view`'s. A run
whose records were tiered (§8.6) is shown as its tombstone says — its state (`archived`)
and where the archive is — and then, read back from that archive blob, as any run.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, assert_never

from pydantic import TypeAdapter, ValidationError

from assay.cli.logs import postgres_log, tenant_arg
from assay.engine.episode_view import (
    AttemptView,
    BranchView,
    IntentView,
    RunView,
    build_run_view,
)
from assay.engine.events import WORK_EVENTS, Tiered, commands_stream, fold_work
from assay.engine.lineage import BranchingChildView, BranchingView
from assay.engine.retention import decode_archive, tiered_stream
from assay.kernel.attempts import AttemptState
from assay.kernel.errors import AssayError
from assay.kernel.ids import Lsn, TenantId
from assay.kernel.intents import IntentState
from assay.messages.branching import BranchDelta
from assay.messages.models import Usage
from assay.record.events import BranchKey, LogRecord
from assay.record.state import StateKey
from assay.runtime.settings import AssaySettings
from assay.store.fs_blobs import FsBlobStore
from assay.store.ports import EventLog
from assay.store.sqlite import SqliteEventLog

EXECUTE_LOG = "execute.sqlite"
"""The execute stage's log in an embedded data directory."""
LOCAL_RUNS_LOG = "local-runs.sqlite"
"""The log `assay run` writes its runs to."""
PG_SCHEMA = "execute"
"""The execute stage's schema in distributed mode."""
_PAGE = 10_000
_DELTAS: TypeAdapter[list[BranchDelta]] = TypeAdapter(list[BranchDelta])


class RunNotFound(AssayError):
    """No such run (of that tenant, when one was given)."""


class RunTiered(AssayError):
    """The run's records left the log for an archive blob (§8.6); its tombstone says where."""

    def __init__(
        self, tenant: TenantId, tiered: Tiered, at_ms: int, grading: str | None = None
    ) -> None:
        self.tenant = tenant
        self.tiered = tiered
        self.at_ms = at_ms
        self.state = "cancelled" if grading == "cancelled" else "archived"
        """Its lifecycle state: `archived` (§5.2), or `cancelled` for a stopped run."""
        super().__init__(
            f"run {tiered.run} was tiered: its {tiered.records} records are in archive blob "
            f"{tiered.archive} of tenant {tenant}"
        )

    def to_json(self) -> dict[str, object]:
        """The JSON form `--json` prints."""
        return {
            "run_id": self.tiered.run,
            "tenant": str(self.tenant),
            "state": self.state,
            "tiered": {
                "archive": self.tiered.archive,
                "records": self.tiered.records,
                "at_ms": self.at_ms,
                "streams": [s.model_dump(mode="json") for s in self.tiered.streams],
            },
        }

    def render(self) -> str:
        """The text form."""
        streams = ", ".join(f"{s.stream}@{s.branch} ({s.records})" for s in self.tiered.streams)
        return (
            f"run {self.tiered.run}  tenant {self.tenant}\n"
            f"  state {self.state}\n"
            f"  tiered {_when(self.at_ms)}: {self.tiered.records} records moved to archive blob "
            f"{self.tiered.archive}\n"
            f"  streams {streams}\n"
            "  the archive is JSON lines, one record each, in the tenant's blobs; "
            "assay.engine.retention.decode_archive reads it back\n"
        )


async def show_command(
    data_dir: Path,
    run: str,
    *,
    tenant: str | None,
    branch: int | None,
    all_branches: bool,
    as_json: bool,
) -> int:
    """Print one run's view: its live branch, `branch`, or every branch.

    Raises:
        AssayError: bad input, an unknown run (or one of another tenant than
            `tenant`), no such branch, or a log that cannot be read.
    """
    only = tenant_arg(tenant) if tenant is not None else None
    if branch is not None and branch < 0:
        raise AssayError(f"--branch must be 0 or more, not {branch}")
    try:
        view = await load_run(data_dir, run, only)
    except RunTiered as tiered:
        archived = await read_archive(data_dir, tiered)  # §8.6: still reads back
        if as_json:
            doc = tiered.to_json()
            doc["view"] = None if archived is None else archived.to_json()
            print(json.dumps(doc, indent=2, ensure_ascii=False))
        else:
            print(tiered.render(), end="")
            if archived is not None:
                print(render_text(archived), end="")
        return 0
    if branch is not None and branch not in view.branch_ids:
        have = ", ".join(str(b) for b in view.branch_ids)
        raise AssayError(f"run {run} has no branch {branch} (it has: {have})")
    if not all_branches:
        view = view.only([view.live_branch if branch is None else branch])
    if as_json:
        print(json.dumps(view.to_json(), indent=2, ensure_ascii=False))
    else:
        print(render_text(view), end="")
    return 0


async def read_archive(data_dir: Path, tiered: RunTiered) -> RunView | None:
    """The view of a tiered run read back from its archive blob — in the data directory's
    blobs, or with `ASSAY_DATABASE_URL` set in the S3 bucket the settings name; None when
    the blob cannot be read here (its tombstone still says where it is)."""
    settings = AssaySettings.from_env()
    if settings.database.url:
        from assay.runtime.distributed import blob_store  # distributed only: kept lazy

        store = blob_store(settings)
        try:
            await store.open()
        except Exception:  # unreachable or misconfigured: the tombstone says where it is
            return None
        try:
            raw = await store.get(tiered.tenant, tiered.tiered.archive)
        finally:
            await store.close()
    else:
        raw = await FsBlobStore(data_dir / "blobs").get(tiered.tenant, tiered.tiered.archive)
    return None if raw is None else archive_view(tiered.tiered.run, raw)


def archive_view(run: str, archive: bytes) -> RunView | None:
    """The view of a run from its archive's bytes (`encode_archive`), or None if it holds
    none of the run's records."""
    records = decode_archive(archive, WORK_EVENTS)
    branches: dict[int, list[LogRecord]] = {}
    for r in records:
        if r.key.stream == run:
            branches.setdefault(r.key.branch, []).append(r)
    if not branches:
        return None
    commands = [r for r in records if r.key.stream == commands_stream(run)]
    return build_run_view(branches, commands)


async def load_run(data_dir: Path, run: str, tenant: TenantId | None) -> RunView:
    """The view of `run` from the execute log this environment points at.

    Raises:
        RunNotFound: no such run — or, with `tenant`, none of that tenant.
        AssayError: the run id exists under several tenants and none was given,
            or the log cannot be read.
    """
    view: RunView | None
    database_url = AssaySettings.from_env().database.url
    if database_url:
        async with postgres_log(database_url, PG_SCHEMA, WORK_EVENTS, fold_work) as log:
            view = await find_run(log, run, tenant)
        where = f"the {PG_SCHEMA} schema of $ASSAY_DATABASE_URL"
    else:
        view, where = None, str(data_dir)
        logs = [p for p in (data_dir / EXECUTE_LOG, data_dir / LOCAL_RUNS_LOG) if p.is_file()]
        if not logs:
            raise RunNotFound(f"no run {run}: no execute log in {data_dir}")
        for path in logs:
            log = await SqliteEventLog(path, WORK_EVENTS, fold_work).open()
            try:
                view = await find_run(log, run, tenant)
            finally:
                await log.close()
            if view is not None:
                break
    if view is None:
        whose = f" of tenant {tenant}" if tenant is not None else ""
        raise RunNotFound(f"no run {run}{whose} in {where}")
    return view


async def find_run(log: EventLog, run: str, tenant: TenantId | None) -> RunView | None:
    """The view of `run` in one log, or None if it has no record of it (of `tenant`).

    Raises:
        RunTiered: its records were moved to an archive; the tombstone says where.
        AssayError: without `tenant`, the run id has records under several tenants.
    """
    keys = await log.branches(run, tenant)
    tombstones = [] if keys else await log.branches(tiered_stream(run), tenant)
    tenants = {k.tenant for k in keys or tombstones}
    if len(tenants) > 1:
        raise AssayError(f"run {run} exists under {len(tenants)} tenants: name one with --tenant")
    for key in tombstones:
        for record in await log.read(key):
            if isinstance(record.event, Tiered):
                doc = await log.get(StateKey(key.tenant, "run", run))
                grading = None if doc is None else doc.get("grading")
                raise RunTiered(key.tenant, record.event, record.at_ms, grading)
    if not keys:
        return None
    commands = await read_branch(log, BranchKey.main(keys[0].tenant, commands_stream(run)))
    return build_run_view({k.branch: await read_branch(log, k) for k in keys}, commands)


async def read_branch(log: EventLog, key: BranchKey) -> list[LogRecord]:
    """Every record of one branch, in LSN order, read a page at a time."""
    records: list[LogRecord] = []
    while True:
        page = await log.read(key, Lsn(records[-1].lsn + 1 if records else 0), _PAGE)
        records.extend(page)
        if len(page) < _PAGE:
            return records


# -- text --------------------------------------------------------------------------


def render_text(view: RunView) -> str:
    """A compact tree: the run, then each shown branch, its steps, attempts and intents."""
    lines = [f"run {view.run_id}  tenant {view.tenant}"]
    ref = view.ref
    if ref is not None:
        lines.append(
            f"  workflow {ref.workflow_id} @ {_short(ref.workflow_version)}  role {ref.role.value}"
            f"  purpose {ref.purpose.value}  task {_short(ref.task_id)}"
        )
    status = _status(view.status.value, view.failed_step, view.indeterminate)
    if view.indeterminate:
        which = ", ".join(str(b) for b in view.indeterminate_branches)
        status += f" (branch {which})"
    lines.append(f"  status {status}")
    lines.append(f"  usage {_usage(view.usage)}")
    lines.append(f"  episode {view.episode or '(none yet)'}")
    lines.append(
        f"  branches {', '.join(str(b) for b in view.branch_ids)}  live {view.live_branch}"
    )
    for branching in view.branchings:
        lines.extend(_branching(branching))
    for branch in view.branches:
        lines.extend(_branch(branch))
    return "\n".join(lines) + "\n"


def _branching(b: BranchingView) -> Iterable[str]:
    """A branch command: where its children departed, how each ended and differed."""
    yield (
        f"  branched after step {b.after_step} (branch {b.from_branch}, lsn {b.at_lsn})"
        f"  parent {b.parent_status}  tree {b.tree}"
    )
    for c in b.children:
        label = f'  "{c.label}"' if c.label else ""
        diverged = f"diverged at {c.diverged_at}: {c.why}" if c.diverged_at else "diverged nowhere"
        yield (
            f"    child {c.child}  branch {c.branch}  {' + '.join(c.deltas)}{label}"
            f"  {_status(c.status, c.failed_step, False)}  {_verified(c)}  {diverged}"
        )


def _verified(c: BranchingChildView) -> str:
    """A child's verifier outcome, beside its execution status."""
    match c.verification:
        case None:
            return "verification pending"
        case "fail" if c.failed_checks:
            return f"verified fail ({', '.join(c.failed_checks)})"
        case "cancelled":
            return "grading cancelled"
        case outcome:
            return f"verified {outcome}"


def _deltas(fields: dict[str, object]) -> str:
    """A fork record's deltas as short labels (a branch command's child), or ''."""
    try:
        deltas = _DELTAS.validate_python(fields.get("deltas") or [])
    except ValidationError:
        return ""
    return " + ".join(d.describe() for d in deltas)


def _branch(b: BranchView) -> Iterable[str]:
    head = f"branch {b.branch}" + (" (live)" if b.live else "")
    if b.fork is not None:
        f = b.fork
        if f.from_branch is not None and f.at_lsn is not None:
            head += f"  forked from branch {f.from_branch} at lsn {f.at_lsn}"
            delta = _deltas(f.fields) if f.type == "Forked" else ""
            if delta:
                head += f"  child {f.fields.get('child')} after {f.fields.get('after_step')}"
                head += f"  delta {delta}"
        else:
            head += f"  forked: {f.type} {json.dumps(f.fields, sort_keys=True)}"
    head += f"  {_status(b.status.value, b.failed_step, b.indeterminate)}"
    if b.started_at_ms is not None:
        head += f"  started {_when(b.started_at_ms)}"
    yield head + f"  {b.records} records"
    for step in b.steps:
        yield f"  step {step.step}" + (f" (iteration {step.iteration})" if step.iteration else "")
        for attempt in step.attempts:
            yield from _attempt(attempt)
    for other in b.other:
        yield f"  record {other.lsn} {other.type} {json.dumps(other.fields, sort_keys=True)}"


def _attempt(a: AttemptView) -> Iterable[str]:
    line = f"    attempt {a.attempt}  {a.state.value}"
    if a.duration_ms is not None:
        line += f"  {_duration(a.duration_ms)}"
    if a.usage is not None and a.usage.model_calls:
        line += f"  {_usage(a.usage)}"
    if a.interrupted:
        line += "  interrupted"
    yield line
    if a.error is not None:
        yield f"      error: {_flat(a.error, 200)}"
    elif a.output is not None:
        yield f"      output: {json.dumps(_flat(a.output, 80), ensure_ascii=False)}"
    for intent in a.intents:
        yield from _intent(intent, finished=a.state is not AttemptState.RUNNING)


def _intent(i: IntentView, *, finished: bool) -> Iterable[str]:
    states = " → ".join(t.state.value for t in i.transitions)
    how = _resolution(i, finished=finished)
    yield f"      intent {i.tool} ({i.effect})  {states}" + (f"  {how}" if how else "")
    key = f"  key {i.idempotency_key}" if i.idempotency_key else ""
    yield f"        request {i.request_id}{key}"


def _resolution(i: IntentView, *, finished: bool) -> str:
    """How the call ended, in §8.4's words."""
    match i.state:
        case IntentState.COMMITTED:
            return f"recovered: {i.resolved_by}" if i.resolved_by else ""
        case IntentState.PENDING:
            return "never dispatched" if finished else "pending"
        case IntentState.DISPATCHED:
            return "unresolved: outcome unknown" if finished else "in flight"
        case _:
            assert_never(i.state)


def _status(status: str, failed_step: str | None, indeterminate: bool) -> str:
    out = status + (f" at step {failed_step}" if failed_step else "")
    return out + (", indeterminate" if indeterminate else "")


def _usage(u: Usage) -> str:
    calls = "1 model call" if u.model_calls == 1 else f"{u.model_calls} model calls"
    return f"{calls}, {u.prompt_tokens} prompt + {u.completion_tokens} completion tokens"


def _duration(ms: int) -> str:
    return f"{ms} ms" if ms < 1000 else f"{ms / 1000:.1f} s"


def _when(ms: int) -> str:
    at = datetime.fromtimestamp(ms / 1000, UTC)
    return at.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _short(digest: str) -> str:
    return digest[:12]


def _flat(text: str, limit: int) -> str:
    one = " ".join(text.split())
    return one if len(one) <= limit else one[: limit - 1] + "…"


async def run_log(log: EventLog, tenant: TenantId, run: str) -> tuple[int, dict[str, Any]]:
    """A run's full log view for one tenant, as the execute stage answers the console:
    200 and the view's JSON form; 404 when the tenant has no such run (another tenant's
    included); 410 when its records were tiered to an archive (the tombstone's JSON)."""
    try:
        view = await find_run(log, run, tenant)
    except RunTiered as tiered:
        return 410, {"detail": f"run {run} was tiered to an archive", **tiered.to_json()}
    if view is None:
        return 404, {"detail": "no such run"}
    return 200, view.to_json()
