"""Execute's derived documents read as their read models (`assay.engine.run_state`) at
every point of a run's life, and the documents the fold writes whole are the models'
dumps."""

from __future__ import annotations

import uuid
from typing import Any

from assay.engine.events import (
    AttemptFinished,
    AttemptStarted,
    CancelRequested,
    Forked,
    GradingEnded,
    Intent,
    Reduced,
    RunCancelled,
    RunFinished,
    RunStarted,
    Signalled,
    Suspended,
    fold_work,
)
from assay.engine.run_state import (
    WORK_STATE,
    AttemptView,
    CancelAsked,
    RunView,
    TieringDue,
    Waiting,
)
from assay.kernel import (
    AttemptNo,
    AttemptState,
    IntentState,
    Lsn,
    RunId,
    StepId,
    TaskId,
    TenantId,
    WorkflowId,
    WorkflowVersion,
)
from assay.messages import Purpose, Role, RunRef, Usage
from assay.record import BranchKey, Event, LogRecord, ReadModel, StateKey, apply_delta
from assay.record.state import Put

TENANT = TenantId(uuid.UUID(int=7))
RUN = RunId("01M8SC9T2V0JTFFYGMB5GF83Q4")
MODELS: dict[str, type[ReadModel]] = {m.kind: m for m in WORK_STATE}


def ref() -> RunRef:
    return RunRef(
        tenant=TENANT,
        run_id=RUN,
        task_id=TaskId("t" * 64),
        idempotency_key="task-1",
        workflow_id=WorkflowId("arith"),
        workflow_version=WorkflowVersion("v" * 64),
        role=Role.CHALLENGER,
        purpose=Purpose.SHADOW,
    )


def life() -> list[tuple[str, Event]]:
    """A run's records across its life, each with the stream it is recorded on."""
    step, n, usage = StepId("answer"), AttemptNo(1), Usage(model_calls=1)
    return [
        (RUN, RunStarted(run=ref(), definition={}, input={})),
        (RUN, AttemptStarted(step=step, attempt=n, iteration=0)),
        (
            RUN,
            Intent(
                step=step,
                attempt=n,
                state=IntentState.DISPATCHED,
                tool="http",
                effect="unsafe",
                request_id="r1",
            ),
        ),
        (
            RUN,
            AttemptFinished(
                step=step,
                attempt=n,
                state=AttemptState.INDETERMINATE,
                error="lost",
                usage=usage,
                duration_ms=3,
            ),
        ),
        (RUN, Suspended(step=StepId("wait"), iteration=0, signal="approval", deadline_ms=9)),
        (f"{RUN}/commands", CancelRequested(reason="operator")),
        (RUN, Signalled(step=StepId("wait"), iteration=0, signal="approval")),
        (RUN, RunCancelled(reason="operator", indeterminate=True, usage=usage)),
        (RUN, Forked(from_branch=0, at=2, discarded_effects=["r1"])),
        (RUN, RunFinished(succeeded=True, episode="e" * 64, usage=usage)),
        (RUN, GradingEnded(status="ungraded")),
        (
            RUN,
            Reduced(
                original="e" * 64, summary="s" * 64, tokens_before=9, tokens_after=3, ceiling=5
            ),
        ),
    ]


def test_every_document_reads_as_its_model_after_every_record() -> None:
    store: dict[StateKey, dict[str, Any]] = {}
    for lsn, (stream, event) in enumerate(life()):
        record = LogRecord(BranchKey.main(TENANT, stream), Lsn(lsn), 1, 1000 + lsn, event)
        for delta in fold_work(record):
            after = apply_delta(store.get(delta.at), delta)
            if after is None:
                store.pop(delta.at, None)
                continue
            store[delta.at] = after
            model = MODELS[delta.at.kind].model_validate(after)
            if isinstance(delta, Put) and delta.at.kind not in ("run", "attempt"):
                assert model.model_dump(mode="json") == after  # written whole: the model's dump
    run = RunView.model_validate(store[RunView.at(TENANT, RUN)])
    assert run.status == "verifying"
    assert run.reduced
    assert run.grading == "ungraded"
    assert run.forked_from is not None
    assert run.forked_from.at == 2
    assert run.role is Role.CHALLENGER
    assert run.indeterminate is True
    assert TieringDue.model_validate(store[TieringDue.at(TENANT, RUN)]).reduced_ms == 1011
    assert Waiting.at(TENANT, RUN) not in store
    assert CancelAsked.at(TENANT, RUN) not in store
    attempt = AttemptView.model_validate(store[AttemptView.at(TENANT, f"{RUN}/0/answer/1")])
    assert attempt.state is AttemptState.INDETERMINATE
    assert attempt.error == "lost"


def test_a_run_document_written_by_its_start_alone_reads_with_defaults() -> None:
    record = LogRecord(BranchKey.main(TENANT, RUN), Lsn(0), 2, 5, RunStarted(run=ref()))
    (put,) = fold_work(record)
    assert isinstance(put, Put)
    run = RunView.model_validate(put.value)
    assert run.status == "running"
    assert run.current_step is None
    assert run.episode is None
    assert not run.reduced
    assert not run.tiered
    assert run.grading is None
