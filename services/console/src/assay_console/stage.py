"""Console: folds what the operator pages show from the topics into its own store.

It consumes `assay.runs` (a run's input), `assay.run-status` (its lifecycle),
`assay.verified` (its verdict and usage, for every run), `assay.graded` (its score)
and `assay.results` (a served run's result and output, and a rollout group's
selection); it emits nothing. It also
folds each model call (`assay.usage`) and judge calibration round for the spend and
judge health page (`spend.py`). Each
fact lands as an event on the run's stream in the console's own log, and folds
into one `RunRow` per run. The store keeps the `console_runs` table in step with
those rows in the same transaction (a `DocumentTable`), so the runs list is one
indexed range scan in run-id order — which is creation order, run ids being ULIDs.
It also folds each workflow's ladder from the loop's topics (`ladder.py`).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer

from assay.grading.sprt import SprtPolicy
from assay.kernel import RunState
from assay.kernel.scores import Score, Ungraded
from assay.messages import (
    AttemptIndeterminate,
    RolloutResult,
    RunGraded,
    RunRef,
    RunResult,
    RunSpawned,
    RunStatusChanged,
    RunVerified,
    Usage,
    VerifierResult,
)
from assay.messages.loop import complete_allocation
from assay.record import (
    BranchKey,
    DocumentTable,
    Event,
    EventRegistry,
    LogRecord,
    Patch,
    ReadModel,
    StateDelta,
    TableColumn,
)
from assay.record.compaction import Compacted, with_compaction
from assay.record.erasure import TenantErased
from assay.runtime import StageDeps, StageSpec, UnitOfWork, routes
from assay_console.ladder import LADDER_EVENTS, LADDER_HANDLERS, fold_ladder
from assay_console.spend import SPEND_EVENTS, SPEND_HANDLERS, USAGE_TABLE, fold_spend


class RunSeen(Event):
    """The run was spawned with this input."""

    type: ClassVar[str] = "console.RunSeen"
    version: ClassVar[int] = 1
    run: RunRef = Field(description="The run.")
    input: dict[str, Any] = Field(description="The immutable task input.")


class StatusSeen(Event):
    """The run entered a lifecycle state."""

    type: ClassVar[str] = "console.StatusSeen"
    version: ClassVar[int] = 1
    run: RunRef = Field(description="The run.")
    state: RunState = Field(description="The state entered.")
    detail: str = Field("", description="Why, for people.")


class IndeterminateSeen(Event):
    """An attempt of the run ended with an outcome nobody can know."""

    type: ClassVar[str] = "console.IndeterminateSeen"
    version: ClassVar[int] = 1
    run: RunRef = Field(description="The run.")
    step: str = Field(description="Step of the attempt.")
    attempt: int = Field(description="Attempt number.")
    tool: str = Field(description="Tool whose call may or may not have landed.")
    reason: str = Field(description="Why the outcome is unknown.")


class VerdictSeen(Event):
    """The verifiers' outcome for the run (every run, shadow ones too)."""

    type: ClassVar[str] = "console.VerdictSeen"
    version: ClassVar[int] = 1
    run: RunRef = Field(description="The run.")
    passed: bool = Field(description="Outcome class.")
    results: list[VerifierResult] = Field(description="Each verifier's result.")
    usage: Usage = Field(description="Model usage of the run.")


class GradeSeen(Event):
    """The run was graded (or ended ungraded)."""

    type: ClassVar[str] = "console.GradeSeen"
    version: ClassVar[int] = 1
    run: RunRef = Field(description="The run.")
    passed: bool = Field(description="Verifier outcome class.")
    score: Score = Field(description="The score.")


class ResultSeen(Event):
    """The run's result, as consumers received it. Version 2 adds when the console
    received it (`at_ms`), the overview's results-out and latency time; a version 1
    result has none and stays out of those series."""

    type: ClassVar[str] = "console.ResultSeen"
    version: ClassVar[int] = 2
    result: RunResult = Field(description="The result.")
    at_ms: int | None = Field(
        None,
        ge=0,
        description=(
            "v2: when the console received the result (ms since the epoch). The envelope's "
            "time is the task's submission (every message a fact causes inherits it), so "
            "this is the result's own time. None only for a result recorded before v2."
        ),
    )


class RolloutSeen(Event):
    """A rollout group closed and its winner was selected (or none was)."""

    type: ClassVar[str] = "console.RolloutSeen"
    version: ClassVar[int] = 1
    result: RolloutResult = Field(description="The group's result, as consumers received it.")


CONSOLE_EVENTS = EventRegistry(
    [
        TenantErased,  # every stage log can hold a tenant's tombstone
        RunSeen,
        StatusSeen,
        IndeterminateSeen,
        VerdictSeen,
        GradeSeen,
        ResultSeen,
        RolloutSeen,
        *LADDER_EVENTS,
        *SPEND_EVENTS,
        Compacted,
    ]
)


@CONSOLE_EVENTS.upcaster("console.AllocationSeen", 1)
def _allocation_seen_v1(payload: dict[str, Any]) -> dict[str, Any]:
    """v1 saw one challenger at most: the list of them, and the shares, are read from it."""
    full = complete_allocation({**payload, "challenger_share": payload["share"]})
    return {**payload, "challengers": full["challengers"], "shares": full["shares"]}


@CONSOLE_EVENTS.upcaster("console.ResultSeen", 1)
def _result_seen_v1(payload: dict[str, Any]) -> dict[str, Any]:
    """v1 did not say when the result arrived: it stays unknown."""
    return {**payload, "at_ms": None}


_ADDED_LATER = ("result_ms",)
"""`RunRow` fields a row folded before they existed does not have."""


class RunRow(ReadModel):
    """What the runs list shows of one run, and filters on. Built by patches, so every
    field has a default."""

    kind: ClassVar[str] = "console_run"
    run_id: str = ""
    task_id: str = ""
    idempotency_key: str = ""
    workflow_id: str = ""
    workflow_version: str = ""
    role: str = ""
    purpose: str = ""
    created_ms: int = 0
    state: str | None = None
    passed: bool | None = None
    status: str | None = None
    score_kind: str | None = None
    ungraded_reason: str | None = None
    indeterminate: bool = False
    result_ms: int | None = None
    """When the console received the run's result (ms since the epoch); absent for a
    result recorded before `ResultSeen` v2 said."""

    @model_serializer(mode="wrap")
    def _omit_unknown(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A row folded before a field existed has none, and its document stays as it was
        folded then (`rebuild --check` compares)."""
        doc: dict[str, Any] = handler(self)
        return {k: v for k, v in doc.items() if k not in _ADDED_LATER or v is not None}


class RolloutRow(ReadModel):
    """A closed rollout group's result, by its task's idempotency key."""

    kind: ClassVar[str] = "console_rollout"
    group: str = ""
    result: dict[str, Any] | None = None


RUNS_TABLE = DocumentTable(
    kind=RunRow.kind,
    table="console_runs",
    columns=(
        TableColumn("workflow_id", "text"),
        TableColumn("workflow_version", "text"),
        TableColumn("idempotency_key", "text"),
        TableColumn("state", "text"),
        TableColumn("passed", "boolean"),
        TableColumn("status", "text"),
        TableColumn("score_kind", "text"),
        TableColumn("ungraded_reason", "text"),
        TableColumn("indeterminate", "boolean"),
        TableColumn("created_ms", "integer"),
        TableColumn("result_ms", "integer"),
    ),
    indexes=(
        ("workflow_id", "workflow_version"),
        ("state",),
        ("passed",),
        ("idempotency_key",),
        ("result_ms", "created_ms"),
    ),
)
"""Every run of a tenant, by run id (creation order) and by each filter; by result time
with its creation time (the overview's results out and latency, `overview_series.py`)."""


CONSOLE_TABLES = (RUNS_TABLE, USAGE_TABLE)
"""The tables the console's store keeps in step with its documents."""


def run_stream(tenant: Any, run_id: str) -> BranchKey:
    """The console's stream of one run."""
    return BranchKey.main(tenant, f"run:{run_id}")


def rollout_stream(tenant: Any, group: str) -> BranchKey:
    """The console's stream of one rollout group (its task's idempotency key)."""
    return BranchKey.main(tenant, f"rollout:{group}")


def ulid_ms(run_id: str) -> int:
    """The creation time a ULID carries, in Unix milliseconds."""
    value = 0
    for c in run_id[:10]:
        value = value * 32 + "0123456789ABCDEFGHJKMNPQRSTVWXYZ".index(c)
    return value


def _identity(run: RunRef) -> dict[str, Any]:
    return {
        "run_id": run.run_id,
        "task_id": run.task_id,
        "idempotency_key": run.idempotency_key,
        "workflow_id": run.workflow_id,
        "workflow_version": run.workflow_version,
        "role": run.role.value,
        "purpose": run.purpose.value,
        "created_ms": ulid_ms(run.run_id),
    }


def _score_fields(score: Score | None) -> dict[str, Any]:
    if score is None:
        return {"score_kind": None, "ungraded_reason": None}
    reason = score.reason.value if isinstance(score, Ungraded) else None
    return {"score_kind": score.kind, "ungraded_reason": reason}


def fold_console(record: LogRecord) -> list[StateDelta]:
    """One `RunRow` per run, patched by each fact about it; one `RolloutRow` per closed
    rollout group; one `WorkflowRow` per workflow (`ladder.py`)."""
    if isinstance(record.event, LADDER_EVENTS):
        return fold_ladder(record)
    if isinstance(record.event, SPEND_EVENTS):
        return fold_spend(record)
    tenant = record.key.tenant
    event = record.event
    if isinstance(event, RolloutSeen):
        group, result = event.result.idempotency_key, event.result.model_dump(mode="json")
        return [Patch(RolloutRow.at(tenant, group), {"group": group, "result": result})]
    if isinstance(event, ResultSeen):
        r = event.result
        fields = {"run_id": r.run_id, "passed": r.passed, "status": r.status}
        if event.at_ms is not None:
            fields["result_ms"] = event.at_ms
        return [Patch(RunRow.at(tenant, r.run_id), fields | _score_fields(r.score))]
    if not isinstance(event, RunSeen | StatusSeen | IndeterminateSeen | VerdictSeen | GradeSeen):
        return []
    fields = _identity(event.run)
    match event:
        case StatusSeen(state=state):
            fields["state"] = state.value
            if state in (RunState.VERIFIED_PASS, RunState.VERIFIED_FAIL):
                fields["passed"] = state is RunState.VERIFIED_PASS
        case IndeterminateSeen():
            fields["indeterminate"] = True
        case VerdictSeen(passed=passed):
            fields["passed"] = passed
        case GradeSeen(passed=passed, score=score):
            fields["passed"] = passed
            fields |= _score_fields(score)
    return [Patch(RunRow.at(tenant, event.run.run_id), fields)]


ConsoleUnitOfWork = UnitOfWork[SprtPolicy]


async def on_run_spawned(msg: RunSpawned, uow: ConsoleUnitOfWork) -> None:
    """Remember the run and its input."""
    uow.record(run_stream(uow.tenant, msg.run.run_id), RunSeen(run=msg.run, input=msg.input))


async def on_status_changed(msg: RunStatusChanged, uow: ConsoleUnitOfWork) -> None:
    """Add a lifecycle state to the run's timeline."""
    event = StatusSeen(run=msg.run, state=msg.state, detail=msg.detail)
    uow.record(run_stream(uow.tenant, msg.run.run_id), event)


async def on_attempt_indeterminate(msg: AttemptIndeterminate, uow: ConsoleUnitOfWork) -> None:
    """Mark the run as holding an attempt whose outcome is unknown."""
    event = IndeterminateSeen(
        run=msg.run, step=msg.step, attempt=msg.attempt, tool=msg.tool, reason=msg.reason
    )
    uow.record(run_stream(uow.tenant, msg.run.run_id), event)


async def on_run_verified(msg: RunVerified, uow: ConsoleUnitOfWork) -> None:
    """Record the run's verdict and usage."""
    event = VerdictSeen(run=msg.run, passed=msg.passed, results=msg.results, usage=msg.usage)
    uow.record(run_stream(uow.tenant, msg.run.run_id), event)


async def on_run_graded(msg: RunGraded, uow: ConsoleUnitOfWork) -> None:
    """Record the run's score."""
    event = GradeSeen(run=msg.run, passed=msg.passed, score=msg.score)
    uow.record(run_stream(uow.tenant, msg.run.run_id), event)


async def on_run_result(msg: RunResult, uow: ConsoleUnitOfWork) -> None:
    """Record the run's result: status, verdict, score, usage, output. A result a higher
    branch's replaced (`superseded_by`) is not the run's any more: the live branch's is."""
    if msg.superseded_by is not None:
        return
    at_ms = int(datetime.now(UTC).timestamp() * 1000)  # the envelope's is the task's time
    uow.record(run_stream(uow.tenant, msg.run_id), ResultSeen(result=msg, at_ms=at_ms))


async def on_rollout_result(msg: RolloutResult, uow: ConsoleUnitOfWork) -> None:
    """Record how a rollout group ended: its siblings, selection and winner."""
    uow.record(rollout_stream(uow.tenant, msg.idempotency_key), RolloutSeen(result=msg))


def create_stage(deps: StageDeps) -> StageSpec:
    """Wire the console's read model: the runs' handlers and the ladder's, one fold, one
    table; the sequential test's policy, to draw the test's path."""
    return StageSpec(
        name="console",
        events=CONSOLE_EVENTS,
        fold=with_compaction(fold_console),
        handlers=routes(
            on_run_spawned,
            on_status_changed,
            on_attempt_indeterminate,
            on_run_verified,
            on_run_graded,
            on_run_result,
            on_rollout_result,
            *LADDER_HANDLERS,
            *SPEND_HANDLERS,
        ),
        deps=deps.sprt,
        tables=CONSOLE_TABLES,
    )
