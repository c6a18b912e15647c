"""The execute stage's log records (`WorkEvent`s) and their fold (§8.2)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from assay.kernel.attempts import AttemptState
from assay.kernel.ids import AttemptNo, StepId
from assay.kernel.intents import IntentState
from assay.messages.models import RunRef, Usage
from assay.record.events import Event, EventRegistry, LogRecord
from assay.record.state import Patch, Put, StateDelta, StateKey


class RunStarted(Event):
    """A run began executing on this branch."""

    type: ClassVar[str] = "RunStarted"
    version: ClassVar[int] = 1
    run: RunRef = Field(description="The run.")


class AttemptStarted(Event):
    """Attempt N of a step is `Running` (§5.1). Committed before the work starts."""

    type: ClassVar[str] = "AttemptStarted"
    version: ClassVar[int] = 1
    step: StepId = Field(description="Step.")
    attempt: AttemptNo = Field(description="Attempt number, 1-based.")
    iteration: int = Field(ge=0, description="Times the step had run before.")
    prompt: str | None = Field(None, description="Rendered prompt (model steps).")
    args: dict[str, str] | None = Field(None, description="Rendered arguments (tool steps).")


class AttemptFinished(Event):
    """Attempt N reached a terminal state. Attempt N is never written again."""

    type: ClassVar[str] = "AttemptFinished"
    version: ClassVar[int] = 1
    step: StepId = Field(description="Step.")
    attempt: AttemptNo = Field(description="Attempt number.")
    state: AttemptState = Field(description="Terminal state.")
    output: str | None = Field(None, description="Output when it succeeded.")
    error: str | None = Field(None, description="Why it did not succeed.")
    usage: Usage = Field(description="Model usage of the attempt.")
    duration_ms: int = Field(ge=0, description="Wall-clock duration.")
    interrupted: bool = Field(
        False, description="Closed on recovery: the worker stopped mid-attempt."
    )


class Intent(Event):
    """A tool call's write-ahead intent reached `state` (§8.4). Committed before going on.

    `Pending` is written before the call is issued, `Dispatched` just before
    it is, `Committed` with its outcome. The request id and idempotency key are
    the ones the tool saw, so a recovery can ask or retry under them.
    """

    type: ClassVar[str] = "Intent"
    version: ClassVar[int] = 1
    step: StepId = Field(description="Step of the attempt making the call.")
    attempt: AttemptNo = Field(description="Attempt making the call.")
    state: IntentState = Field(description="Intent state entered.")
    tool: str = Field(description="Tool called.")
    effect: str = Field(description="Its declared effect class (idempotent, queryable, unsafe).")
    request_id: str = Field(description="Names this call; queryable tools tag the request with it.")
    idempotency_key: str | None = Field(None, description="Kernel-derived key (idempotent).")
    output: str | None = Field(None, description="Committed: the call's output.")
    error: str | None = Field(None, description="Committed: the call's reported failure.")
    resolved_by: str | None = Field(
        None, description="Committed on recovery: how (retried with key, lookup, re-dispatch)."
    )


class RunFinished(Event):
    """Every step is terminal; the frozen episode is stored."""

    type: ClassVar[str] = "RunFinished"
    version: ClassVar[int] = 1
    succeeded: bool = Field(description="Every step ended with a succeeded attempt.")
    failed_step: StepId | None = Field(None, description="Step whose attempts ran out.")
    episode: str = Field(description="BlobRef of the episode.")
    usage: Usage = Field(description="Model usage of the run.")


WORK_EVENTS = EventRegistry([RunStarted, AttemptStarted, Intent, AttemptFinished, RunFinished])


def fold_work(record: LogRecord) -> list[StateDelta]:
    """Derived run and attempt documents, from one record alone."""
    t, run, branch = record.key.tenant, record.key.stream, record.key.branch
    run_doc = StateKey(t, "run", run)
    match record.event:
        case RunStarted(run=ref):
            return [
                Put(
                    run_doc,
                    {
                        "status": "running",
                        "branch": branch,
                        "workflow_id": ref.workflow_id,
                        "workflow_version": ref.workflow_version,
                        "role": ref.role.value,
                        "purpose": ref.purpose.value,
                        "task_id": ref.task_id,
                        "attempts": 0,
                        "started_ms": record.at_ms,
                    },
                )
            ]
        case AttemptStarted(step=step, attempt=n, iteration=i):
            return [
                Patch(run_doc, {"current_step": step, "last_lsn": record.lsn}),
                Put(
                    StateKey(t, "attempt", f"{run}/{branch}/{step}/{n}"),
                    {"state": AttemptState.RUNNING.value, "iteration": i},
                ),
            ]
        case Intent(step=step, attempt=n, state=state, tool=tool, effect=effect):
            return [
                Patch(run_doc, {"last_lsn": record.lsn}),
                Put(
                    StateKey(t, "intent", f"{run}/{branch}/{step}/{n}"),
                    {"state": state.value, "tool": tool, "effect": effect},
                ),
            ]
        case AttemptFinished(step=step, attempt=n, state=state, error=error):
            extra = {"indeterminate": True} if state is AttemptState.INDETERMINATE else {}
            return [
                Patch(run_doc, {"last_lsn": record.lsn, **extra}),
                Patch(
                    StateKey(t, "attempt", f"{run}/{branch}/{step}/{n}"),
                    {"state": state.value, "error": error},
                ),
            ]
        case RunFinished(succeeded=ok, episode=episode, usage=usage):
            return [
                Patch(
                    run_doc,
                    {
                        "status": "verifying",
                        "succeeded": ok,
                        "episode": episode,
                        "model_calls": usage.model_calls,
                        "finished_ms": record.at_ms,
                    },
                )
            ]
    return []
