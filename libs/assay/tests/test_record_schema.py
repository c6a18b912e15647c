"""Versioned contracts (§8.7): registries, upcasters, state deltas, and every type's round trip."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any, ClassVar

import pytest
from pydantic import Field

from assay.engine import WORK_EVENTS, AttemptFinished, AttemptStarted, RunFinished, RunStarted
from assay.engine.events import (
    ArchivedBranch,
    BranchTreeRecorded,
    BranchVerified,
    CancelRequested,
    Forked,
    GradingEnded,
    Intent,
    Reduced,
    Routed,
    RunCancelled,
    SandboxCheckpointed,
    SandboxReleased,
    SandboxStarted,
    Signalled,
    SnapshotDocument,
    Suspended,
    Tiered,
    TieringQueued,
)
from assay.engine.staged_events import (
    EffectDiscarded,
    EffectPublished,
    EffectPublishing,
    EffectStaged,
    Publication,
)
from assay.grading.ladder import Standing
from assay.kernel import (
    AttemptNo,
    AttemptState,
    IntentState,
    RunId,
    RunState,
    StepId,
    TaskId,
    WorkflowId,
    WorkflowVersion,
    content_hash,
    tenant_id,
)
from assay.kernel.schema import SchemaRegistry, Versioned
from assay.kernel.scores import (
    AttemptRank,
    Capped,
    CoreViolation,
    DecidedBy,
    Outcome,
    Ranked,
    Relative,
    StepCredit,
    Ungraded,
    UngradedReason,
    Verdict,
    WinRecord,
)
from assay.messages import (
    MESSAGES,
    AllocationChanged,
    AttemptIndeterminate,
    BranchChild,
    BranchRun,
    BranchTree,
    CalibrationDue,
    CancelGrading,
    CancelRollout,
    CancelRun,
    ChallengerRejected,
    EpisodeReduced,
    FailureEvidence,
    GradingCancelled,
    GroupDue,
    HeldOutTally,
    InjectPlanDelta,
    JudgeCalibrated,
    Ladder,
    ModelParamsDelta,
    Promoted,
    PromptDelta,
    ProposalRequested,
    Purpose,
    ReviewProposal,
    RewindRun,
    Role,
    RolledBack,
    RolloutBudget,
    RolloutClosed,
    RolloutProgress,
    RolloutRef,
    RolloutResult,
    RolloutSpec,
    RunBranch,
    RunExecuted,
    Rung,
    RunGraded,
    RunRef,
    RunResult,
    RunSpawned,
    RunStatusChanged,
    RunVerified,
    SelectionRecord,
    SiblingResult,
    SignalRun,
    StrengthSummary,
    TaskSubmitted,
    TenantDeleted,
    TenantStageDeleted,
    ToolUnavailableDelta,
    Usage,
    UsageRecorded,
    VariantAggregate,
    VerifierResult,
    WorkflowRegistered,
)
from assay.messages.branching import (
    AnyDelta,
    BranchBoundary,
    BranchOutcome,
    BranchTreeChild,
    Divergence,
    StageAttribution,
)
from assay.messages.candidates import MatrixEstimate, PlannedCandidate
from assay.record import (
    Delete,
    Event,
    EventRegistry,
    Patch,
    Put,
    StateKey,
    UnknownSchema,
    apply_delta,
)
from assay.record.compaction import Compacted, RestatedDocument
from assay.record.erasure import TenantErased
from assay_aggregate import AGGREGATE_EVENTS
from assay_aggregate.stage import FailuresKept, VersionTallied
from assay_decide import DECIDE_EVENTS
from assay_decide.events import (
    JudgeHealthNoted,
    ProposalMade,
    ProposalNotMade,
    ProposalReviewed,
)
from assay_decide.stage import AllocationSet, ChallengerDecided, EvidenceAccepted, PromotionHeld
from assay_ingest import INGEST_EVENTS
from assay_ingest.matrix import MatrixAdmitted
from assay_ingest.replay import CutReason, CutRun, ReplayMetered
from assay_ingest.rollouts import RolloutAdmitted, RolloutUpdated
from assay_ingest.state import AllocationApplied, SpawnedRun, TaskAccepted, WorkflowStored
from assay_tournament import TOURNAMENT_EVENTS
from assay_tournament.events import (
    CalibrationEpisodeKept,
    CalibrationRan,
    ChallengerParked,
    EpisodeSummarised,
    GradingMetered,
    GradingStopped,
    GroupClosed,
    GroupJoined,
    JudgeAnswered,
    ReferenceSet,
    ReplaySpent,
    ResultIssued,
    RolloutSelected,
    RunScored,
    SiblingWaiting,
)
from assay_verify import VERIFY_EVENTS
from assay_verify.stage import RunVerdictRecorded, VerificationStopped

# --- local event types for the registry mechanics ----------------------------------------------


class Note(Event):
    """Current version 2: v1 had no `author`."""

    type: ClassVar[str] = "LocalNote"
    version: ClassVar[int] = 2
    text: str = Field(description="Body.")
    author: str = Field(description="Who wrote it (added in v2).")


class Tally(Event):
    """Current version 3; only the 2 -> 3 upcaster exists."""

    type: ClassVar[str] = "LocalTally"
    version: ClassVar[int] = 3
    count: int = Field(ge=0, description="Count.")


class ImpostorNote(Event):
    """A different class claiming Note's stored type name."""

    type: ClassVar[str] = "LocalNote"
    version: ClassVar[int] = 1
    text: str = Field(description="Body.")


def _registry() -> EventRegistry:
    reg = EventRegistry([Note, Tally])

    @reg.upcaster("LocalNote", 1)
    def note_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
        return {**payload, "author": "unknown"}

    @reg.upcaster("LocalTally", 2)
    def tally_v2_to_v3(payload: dict[str, Any]) -> dict[str, Any]:
        return {"count": payload["n"]}

    return reg


def test_registry_decodes_a_payload_at_the_current_version() -> None:
    assert _registry().decode("LocalNote", 2, {"text": "hi", "author": "ann"}) == Note(
        text="hi", author="ann"
    )


def test_registry_upcasts_a_v1_payload_through_the_registered_upcaster() -> None:
    payload = {"text": "hi"}
    decoded = _registry().decode("LocalNote", 1, payload)
    assert decoded == Note(text="hi", author="unknown")
    assert payload == {"text": "hi"}


def test_registry_lists_every_version_that_still_decodes() -> None:
    reg = _registry()
    assert reg.versions("LocalNote") == [1, 2]
    assert reg.versions("LocalTally") == [2, 3]
    assert reg.types() == {"LocalNote": Note, "LocalTally": Tally}


def test_a_gap_in_the_upcaster_chain_is_unknown_schema() -> None:
    reg = _registry()
    assert reg.decode("LocalTally", 2, {"n": 4}) == Tally(count=4)
    with pytest.raises(UnknownSchema, match="no upcaster for 'LocalTally' from version 1"):
        reg.decode("LocalTally", 1, {"n": 4})


@pytest.mark.parametrize("version", [3, 7])
def test_a_version_newer_than_the_code_is_unknown_schema_naming_the_version(version: int) -> None:
    with pytest.raises(
        UnknownSchema, match=re.escape(f"schema version {version}; this code reads 1..2")
    ):
        _registry().decode("LocalNote", version, {"text": "hi", "author": "ann"})


@pytest.mark.parametrize("version", [0, -1])
def test_a_version_below_one_is_unknown_schema(version: int) -> None:
    with pytest.raises(UnknownSchema, match=f"schema version {version}"):
        _registry().decode("LocalNote", version, {"text": "hi"})


def test_an_unknown_type_is_unknown_schema() -> None:
    with pytest.raises(UnknownSchema, match="unknown type 'LocalNope'"):
        _registry().decode("LocalNope", 1, {})


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"text": "hi"}, "author"),  # missing at the current version
        ({"text": 3, "author": "ann"}, "text"),  # wrong type
        ({"text": "hi", "author": "ann", "extra": 1}, "extra"),  # unknown field
    ],
)
def test_a_payload_that_does_not_validate_is_one_line_naming_the_field(
    payload: dict[str, Any], field: str
) -> None:
    with pytest.raises(UnknownSchema) as info:
        _registry().decode("LocalNote", 2, payload)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"'LocalNote' v2: {field}:")


def test_an_upcast_payload_that_does_not_validate_names_the_current_version() -> None:
    with pytest.raises(UnknownSchema, match=r"'LocalTally' v3: count:"):
        _registry().decode("LocalTally", 2, {"n": -1})


def test_registering_the_same_type_name_twice_raises_value_error() -> None:
    reg = _registry()
    with pytest.raises(ValueError, match="'LocalNote' registered twice"):
        reg.register(ImpostorNote)
    assert reg.types()["LocalNote"] is Note


def test_registering_the_same_class_again_is_harmless() -> None:
    reg = _registry()
    assert reg.register(Note) is Note
    assert reg.types()["LocalNote"] is Note


def test_a_schema_registry_works_as_a_decorator() -> None:
    reg: SchemaRegistry[Versioned] = SchemaRegistry()

    @reg.register
    class Ping(Versioned):
        type: ClassVar[str] = "LocalPing"
        version: ClassVar[int] = 1
        n: int = Field(description="Sequence.")

    assert reg.decode("LocalPing", 1, {"n": 1}) == Ping(n=1)


# --- state deltas -------------------------------------------------------------------------------

KEY = StateKey(tenant_id(uuid.UUID(int=1)), "run", "r1")


def test_put_replaces_the_document_whatever_was_there() -> None:
    value = {"a": 1}
    assert apply_delta({"old": True}, Put(KEY, value)) == {"a": 1}
    assert apply_delta(None, Put(KEY, value)) == {"a": 1}
    result = apply_delta(None, Put(KEY, value))
    assert result is not value


def test_patch_merges_shallowly_and_creates_an_absent_document() -> None:
    current = {"a": 1, "nested": {"x": 1}}
    patched = apply_delta(current, Patch(KEY, {"b": 2, "nested": {"y": 2}}))
    assert patched == {"a": 1, "b": 2, "nested": {"y": 2}}
    assert current == {"a": 1, "nested": {"x": 1}}
    assert apply_delta(None, Patch(KEY, {"b": 2})) == {"b": 2}


def test_delete_removes_the_document_and_is_a_no_op_when_absent() -> None:
    assert apply_delta({"a": 1}, Delete(KEY)) is None
    assert apply_delta(None, Delete(KEY)) is None


def test_state_keys_order_by_tenant_first() -> None:
    t1, t2 = tenant_id(uuid.UUID(int=1)), tenant_id(uuid.UUID(int=2))
    keys = [StateKey(t2, "a", "a"), StateKey(t1, "z", "z")]
    assert sorted(keys)[0].tenant == t1


# --- examples of every message and event --------------------------------------------------------

TENANT = tenant_id("6f1c7a8e-2b0d-4c1e-9a55-3d1f0e2b7c44")
RUN = RunId("01HZX3V8Q6M9T2K4R7W1Y5N0BC")
OTHER_RUN = RunId("01HZX3V8Q6M9T2K4R7W1Y5N0BD")
TASK = TaskId(content_hash({"question": "2+2"}))
WF = WorkflowId("arith")
V1 = WorkflowVersion(content_hash("v1"))
V2 = WorkflowVersion(content_hash("v2"))
DEFINITION: dict[str, Any] = {
    "id": "arith",
    "steps": [{"id": "solve", "kind": "model", "prompt": "What is {{ task.question }}?"}],
}
USAGE = Usage(model_calls=2, prompt_tokens=40, completion_tokens=8)
REF = RunRef(
    tenant=TENANT,
    run_id=RUN,
    task_id=TASK,
    idempotency_key="order-17",
    workflow_id=WF,
    workflow_version=V2,
    role=Role.CHALLENGER,
    purpose=Purpose.SHADOW,
    baseline_version=V1,
    reference_expected=True,
    held_out=True,
)
SPEC = RolloutSpec(
    n=6,
    mode="best_of_n",
    admit=5,
    budget=RolloutBudget(
        max_concurrency=2,
        run_max_model_calls=2,
        group_max_model_calls=10,
        deadline_s=600,
        run_max_tokens=4000,
        group_max_tokens=20000,
        run_max_cost_usd=0.002,
        group_max_cost_usd=0.01,
    ),
)
SIBLING = REF.model_copy(
    update={
        "role": Role.CURRENT,
        "purpose": Purpose.WORK,
        "baseline_version": None,
        "reference_expected": False,
        "rollout": RolloutRef(
            group="order-18",
            index=1,
            size=5,
            mode="best_of_n",
            max_model_calls=2,
            max_tokens=4000,
            max_cost_usd=0.002,
        ),
    }
)
RESULT = VerifierResult(
    verifier="correct", kind="exact", verifier_version="1", passed=True, evidence="4 == 4"
)
RECORD = WinRecord(judge_wins=3, judge_losses=1, draws=2, verifier_wins=1, capped=1)
RELATIVE = Relative(
    against=OTHER_RUN,
    verdict=Verdict.B,
    position="b",
    outcome=Outcome.WIN,
    decided_by=DecidedBy.JUDGE,
)
SCORES = [
    RELATIVE,
    Ranked(strength=0.25, interval=(-0.5, 1.0), group_size=4),
    Ranked(strength=-0.4, interval=(-1.5, 0.7), group_size=3, anchored=False),
    RELATIVE.model_copy(update={"order_consistent": False}),
    Capped(violations=[CoreViolation(criterion="no-guessing", evidence="guessed 5")]),
    Ungraded(reason=UngradedReason.BASELINE),
]
CREDIT = StepCredit(
    step="solve",
    iteration=0,
    failed_attempt=1,
    passed_attempt=2,
    failure="wrong answer",
    changed=["prompt (40 -> 52 characters)"],
)
FAILED = VerifierResult(
    verifier="correct", kind="exact", verifier_version="1", passed=False, evidence="5 != 4"
)
FAILURE = FailureEvidence(
    run_id=RUN,
    task_id=TASK,
    workflow_version=V1,
    failed_checks=[FAILED],
    capped=[CoreViolation(criterion="no-guessing", evidence="guessed 5")],
    step_credit=[CREDIT],
)
PROPOSAL = ProposalRequested(
    tenant=TENANT,
    workflow_id=WF,
    proposal_id="0123456789abcdef",
    workflow_version=V2,
    parent=V1,
    after=V2,
    definition={"id": "arith", "steps": []},
    rationale="reason_step_by_step: asks model step(s) solve to reason step by step",
    proposer="catalog",
    evidence=[RUN],
    usage=Usage(model_calls=1, prompt_tokens=900, completion_tokens=300),
    gated=True,
)
ATTEMPT_RANK = AttemptRank(
    step="solve",
    iteration=0,
    attempt=2,
    succeeded=False,
    rank=Ranked(strength=0.8, interval=(-0.9, 2.5), group_size=2),
)
ALLOCATION = AllocationChanged(
    tenant=TENANT,
    workflow_id=WF,
    generation=2,
    current=V1,
    challenger=V2,
    challenger_share=0.1,
    shadow_rate=0.5,
    definitions={V1: DEFINITION, V2: DEFINITION},
    rung=Rung.RAMP,
    ladder=Ladder.RESOURCED,
)
VERIFIED = RunVerified(
    run=REF, episode="blob:abc", passed=True, results=[RESULT], usage=USAGE, executed=True
)

DELTAS: list[AnyDelta] = [
    PromptDelta(kind="prompt", step=StepId("solve"), prompt="Solve {{ task.question }}."),
    ModelParamsDelta(kind="model_params", step=StepId("solve"), max_tokens=64, max_attempts=2),
    ToolUnavailableDelta(kind="tool_unavailable", tool="search"),
    InjectPlanDelta(kind="inject_plan", plan="Restate the problem, then solve it."),
]
OUTCOME = BranchOutcome(
    status="failed",
    failed_step=StepId("check"),
    usage=USAGE,
    usage_after_boundary=Usage(model_calls=1, prompt_tokens=20, completion_tokens=4),
    episode="blob:abc",
)
TREE = BranchTree(
    kind="assay-branch",
    tenant=TENANT,
    run_id=RUN,
    command="m-2",
    reason="ablation",
    workflow_id=WF,
    workflow_version=V2,
    boundary=BranchBoundary(step=StepId("plan"), branch=0, at=5),
    parent=OUTCOME.model_copy(update={"status": "succeeded", "failed_step": None, "output": "4"}),
    children=[
        BranchTreeChild(
            child=1,
            branch=1,
            label="no search",
            deltas=[DELTAS[2]],
            outcome=OUTCOME,
            diverged_at=Divergence(
                step=StepId("check"), iteration=0, why="it failed here and succeeded in the parent"
            ),
            result="blob:def",
        )
    ],
    attribution=[StageAttribution(step=StepId("check"), children=[1])],
)

CALIBRATED = JudgeCalibrated(
    tenant=TENANT,
    judge="stub",
    due_ms=1_764_624_000_000,
    source="verified_runs",
    pairs=3,
    judged=6,
    agreed=4,
    draws=1,
    failures=0,
    checked=3,
    inconsistent=2,
    agreement=4 / 6,
    order_inconsistency_rate=2 / 3,
    model_calls=6,
    cost_usd=0.0012,
)

MESSAGE_EXAMPLES: list[Versioned] = [
    TaskSubmitted(
        tenant=TENANT,
        workflow_id=WF,
        idempotency_key="order-17",
        input={"question": "2+2", "answer": "4"},
        task_key="arith/2+2",
    ),
    TaskSubmitted(
        tenant=TENANT,
        workflow_id=WF,
        idempotency_key="order-18",
        input={"question": "17 * 23", "answer": "391"},
        rollout=SPEC,
    ),
    WorkflowRegistered(tenant=TENANT, definition=DEFINITION, rewrite=True),
    WorkflowRegistered(tenant=TENANT, definition=DEFINITION, parents=[V1, V2]),
    RunSpawned(run=SIBLING, definition=DEFINITION, input={"question": "17 * 23"}),
    RunVerified(
        run=SIBLING,
        episode="blob:def",
        passed=True,
        results=[RESULT],
        usage=USAGE,
        cost_usd=0.00042,
        executed=True,
    ),
    RolloutProgress(
        tenant=TENANT,
        idempotency_key="order-18",
        run_id=RUN,
        index=1,
        ended="verified",
        model_calls=2,
        tokens=96,
        cost_usd=0.00042,
    ),
    CancelRollout(tenant=TENANT, idempotency_key="order-18", reason="enough"),
    TenantDeleted(tenant=TENANT, reason="contract ended"),
    TenantStageDeleted(
        tenant=TENANT, stage="verify", command="0f3a9c2e5b7d4a1c", blobs=12, workspaces=0
    ),
    RolloutClosed(
        tenant=TENANT,
        task_id=TASK,
        idempotency_key="order-18",
        workflow_id=WF,
        workflow_version=V1,
        spec=SPEC,
        admitted=5,
        runs=[RUN, OTHER_RUN],
        cancelled=[OTHER_RUN],
        reason="cancelled",
        detail="enough",
        model_calls=3,
        cost_usd=0.0006,
        peak_concurrency=2,
    ),
    RolloutResult(
        tenant=TENANT,
        idempotency_key="order-18",
        task_id=TASK,
        workflow_id=WF,
        workflow_version=V1,
        mode="best_of_n",
        requested=6,
        admitted=5,
        siblings=[
            SiblingResult(
                run_id=RUN,
                index=0,
                ended="verified",
                passed=True,
                verification=[RESULT],
                usage=USAGE,
                rank=Ranked(strength=0.4, interval=(-0.9, 1.7), group_size=2, anchored=False),
            ),
            SiblingResult(
                run_id=OTHER_RUN,
                index=1,
                ended="cancelled",
                passed=False,
                verification=[],
                usage=USAGE,
            ),
        ],
        passes=1,
        pass_at_k=[1.0],
        best_of_n_passed=True,
        winner=RUN,
        output="391",
        selection=SelectionRecord(
            policy="verifier_then_judge",
            policy_version=1,
            decided_by="verifier",
            evidence="sibling #0 alone passed without a Core violation",
            judge_calls=0,
        ),
        closed="cancelled",
        detail="enough",
        model_calls=3,
        cost_usd=0.0006,
        peak_concurrency=2,
    ),
    RunSpawned(run=REF, definition=DEFINITION, input={"question": "2+2"}),
    RunStatusChanged(run=REF, state=RunState.VERIFYING, detail="all steps terminal"),
    CancelRun(tenant=REF.tenant, run_id=REF.run_id, reason="wrong input"),
    CancelGrading(
        run=REF.model_copy(update={"branch": RunBranch(branch=2, parent=1, child=1)}),
        reason="wrong input",
        succeeded=True,
        usage=USAGE,
    ),
    GradingCancelled(run=REF, reason="wrong input", succeeded=False, usage=USAGE, verified=True),
    EpisodeReduced(
        tenant=REF.tenant,
        run_id=REF.run_id,
        task_id=REF.task_id,
        original="blob:abc",
        summary="blob:def",
    ),
    RewindRun(tenant=REF.tenant, run_id=REF.run_id, at=3, branch=None, reason="retry"),
    BranchRun(
        tenant=REF.tenant,
        run_id=REF.run_id,
        at_step=StepId("plan"),
        branch=0,
        children=[BranchChild(deltas=[d], label=d.kind) for d in DELTAS],
        reason="ablation",
    ),
    SignalRun(tenant=REF.tenant, run_id=REF.run_id, signal="approval", payload="ok"),
    AttemptIndeterminate(
        run=REF,
        step=StepId("pay"),
        attempt=1,
        tool="charge",
        request_id="t/r/0/pay/1",
        reason="outcome unknown",
    ),
    RunExecuted(
        run=REF, episode="blob:abc", succeeded=False, failed_step=StepId("solve"), usage=USAGE
    ),
    RunExecuted(run=SIBLING, episode="blob:def", succeeded=True, usage=USAGE, cost_usd=0.00042),
    VERIFIED,
    GroupDue(tenant=TENANT, task_id=TASK, passed=False, epoch=3),
    *[RunGraded(run=REF, passed=True, score=score, judge_calls=1) for score in SCORES],
    RunGraded(
        run=REF,
        passed=True,
        score=SCORES[1],
        judge_calls=4,
        attempt_ranks=[ATTEMPT_RANK],
        step_credit=[CREDIT],
    ),
    RunGraded(run=REF, passed=False, score=SCORES[0], judge_calls=1, failed_checks=[FAILED]),
    RunResult(
        tenant=TENANT,
        run_id=RUN,
        task_id=TASK,
        idempotency_key="order-17",
        workflow_id=WF,
        workflow_version=V2,
        status="graded",
        passed=True,
        verification=[RESULT],
        score=SCORES[1],
        usage=USAGE,
        termination="succeeded",
        output="4",
        step_credit=[CREDIT],
        held_out=True,
    ),
    VariantAggregate(
        tenant=TENANT,
        workflow_id=WF,
        workflow_version=V2,
        baseline_version=V1,
        record=RECORD,
        runs=7,
        passes=5,
    ),
    VariantAggregate(
        tenant=TENANT,
        workflow_id=WF,
        workflow_version=V2,
        baseline_version=V1,
        record=RECORD,
        runs=7,
        passes=5,
        strength=StrengthSummary(episodes=5, mean=0.3, interval=(0.1, 0.5), unanchored=1),
    ),
    VariantAggregate(
        tenant=TENANT,
        workflow_id=WF,
        workflow_version=V2,
        baseline_version=V1,
        record=RECORD,
        runs=7,
        passes=5,
        screened=6,
        served=2,
        baseline_runs=30,
        baseline_passes=21,
        order_checked=4,
        order_inconsistent=1,
        held_out=HeldOutTally(
            runs=3,
            passes=1,
            record=RECORD,
            strength=StrengthSummary(episodes=2, mean=-0.1, interval=(-0.9, 0.7), unanchored=0),
            baseline_runs=8,
            baseline_passes=6,
        ),
        failures=[FAILURE],
    ),
    ALLOCATION,
    Promoted(
        tenant=TENANT,
        workflow_id=WF,
        workflow_version=V2,
        previous=V1,
        record=RECORD,
        llr=2.94,
    ),
    ChallengerRejected(
        tenant=TENANT,
        workflow_id=WF,
        workflow_version=V2,
        reason="crossed the reject boundary",
        record=RECORD,
        llr=-2.25,
    ),
    RolledBack(
        tenant=TENANT,
        workflow_id=WF,
        workflow_version=V2,
        current=V1,
        rung=Rung.TRIAL,
        trigger="pass_rate",
        reason="pass rate 40% below 90%",
        record=RECORD,
        runs=20,
        passes=8,
        baseline_runs=40,
        baseline_passes=36,
    ),
    PROPOSAL,
    ReviewProposal(
        tenant=TENANT,
        workflow_id=WF,
        proposal_id="0123456789abcdef",
        approve=False,
        reason="keep prompts short",
    ),
    UsageRecorded(
        tenant=TENANT,
        run_id=RUN,
        purpose=Purpose.GRADING,
        model="stub",
        prompt_tokens=120,
        completion_tokens=3,
        cost_usd=0.000126,
    ),
    CalibrationDue(tenant=TENANT, due_ms=1_764_624_000_000),
    CALIBRATED,
]

COMPACTED = Compacted(
    dropped=3,
    below_ms=1_700_000_000_000,
    documents=[
        RestatedDocument(kind="tally", key="v1", value={"runs": 3}),
        RestatedDocument(kind="parked", key="t/r", value=None),
    ],
)
"""Retention's checkpoint, which every stage with a compaction rule registers."""

EVENT_EXAMPLES: dict[str, tuple[EventRegistry, list[Event]]] = {
    "work": (
        WORK_EVENTS,
        [
            COMPACTED,
            RunStarted(run=REF),
            AttemptStarted(
                step=StepId("solve"), attempt=AttemptNo(2), iteration=1, prompt="What is 2+2?"
            ),
            AttemptStarted(
                step=StepId("answer"), attempt=AttemptNo(1), iteration=0, args={"text": "4"}
            ),
            AttemptFinished(
                step=StepId("solve"),
                attempt=AttemptNo(2),
                state=AttemptState.INDETERMINATE,
                error="worker stopped",
                usage=USAGE,
                duration_ms=1200,
                interrupted=True,
            ),
            Intent(
                step=StepId("answer"),
                attempt=AttemptNo(1),
                state=IntentState.DISPATCHED,
                tool="charge",
                effect="unsafe",
                request_id="t/r/0/answer/1",
            ),
            Routed(step=StepId("route"), iteration=0, to=StepId("answer"), branch=0),
            EffectStaged(
                step=StepId("charge"),
                attempt=AttemptNo(1),
                iteration=0,
                tool="charge",
                effect_key="k" * 64,
                args_hash="a" * 64,
            ),
            EffectPublishing(
                branch=0,
                effect_key="k" * 64,
                state=IntentState.DISPATCHED,
                tool="charge",
                request_id="t/r/publish/k",
            ),
            EffectPublished(
                branch=0,
                effect_key="k" * 64,
                tool="charge",
                state=Publication.INDETERMINATE,
                error="timed out after 30.0s",
            ),
            EffectDiscarded(
                branch=0, effect_key="k" * 64, tool="charge", reason="sibling #1 was not selected"
            ),
            CancelRequested(reason="wrong input"),
            Suspended(step=StepId("ask"), iteration=0, signal="approval", deadline_ms=1),
            Signalled(step=StepId("ask"), iteration=0, signal="approval", payload="ok"),
            Forked(from_branch=0, at=3, reason="retry", command="m-1", discarded_effects=["r"]),
            Forked(
                from_branch=0,
                at=5,
                reason="ablation",
                command="m-2",
                deltas=DELTAS,
                child=2,
                after_step=StepId("plan"),
                label="all four",
            ),
            BranchTreeRecorded(tree_ref="blob:ghi", tree=TREE),
            BranchVerified(branch=2, status="graded", passed=False, failed_checks=["correct"]),
            RunCancelled(reason="cancelled by operator", indeterminate=True, usage=USAGE),
            RunFinished(
                succeeded=False, failed_step=StepId("solve"), episode="blob:abc", usage=USAGE
            ),
            GradingEnded(status="ungraded"),
            TieringQueued(),
            Reduced(
                original="blob:abc",
                summary="blob:def",
                tokens_before=250_000,
                tokens_after=12_000,
                ceiling=200_000,
            ),
            Tiered(
                run=REF.run_id,
                archive="blob:ghi",
                records=7,
                streams=[
                    ArchivedBranch(stream=REF.run_id, branch=0, records=6),
                    ArchivedBranch(stream=f"{REF.run_id}/commands", branch=0, records=1),
                ],
                documents=[
                    SnapshotDocument(kind="run", key=REF.run_id, value={"status": "verifying"}),
                    SnapshotDocument(kind="cancel", key=REF.run_id, value={"reason": "late"}),
                ],
            ),
            SandboxStarted(
                generation=2, identity="t/r/0/g2/abc", restored_from="blob:abc", start_ms=140
            ),
            SandboxCheckpointed(generation=1, workspace="blob:abc"),
            SandboxReleased(generation=1, wait="model"),
        ],
    ),
    "ingest": (
        INGEST_EVENTS,
        [
            COMPACTED,
            WorkflowStored(
                workflow_id=WF,
                workflow_version=V2,
                parents=[V1],
                definition=DEFINITION,
                added=["check"],
                removed=[],
            ),
            AllocationApplied(allocation=ALLOCATION.model_dump(mode="json")),
            TaskAccepted(
                idempotency_key="order-17",
                task_id=TASK,
                workflow_id=WF,
                generation=2,
                serve_draw=0.73,
                shadow_draw=0.12,
                runs=[
                    SpawnedRun(
                        run_id=RUN, workflow_version=V1, role=Role.CURRENT, purpose=Purpose.WORK
                    ),
                    SpawnedRun(
                        run_id=OTHER_RUN,
                        workflow_version=V2,
                        role=Role.CHALLENGER,
                        purpose=Purpose.SHADOW,
                    ),
                ],
                arm=Role.CURRENT,
                rung=Rung.SHADOW,
                held_out=True,
                held_out_draw=0.07,
                cut=[
                    CutRun(
                        run_id=OTHER_RUN,
                        workflow_version=V1,
                        role=Role.CURRENT,
                        purpose=Purpose.SHADOW,
                        reason=CutReason.REPLAY_BUDGET_EXHAUSTED,
                        calls=50,
                    )
                ],
                replay_calls=50,
            ),
            ReplayMetered(
                meter={
                    "day": "2026-11-29",
                    "calls_today": 50,
                    "runs_today": 1,
                    "cut_today": 1,
                    "calls_total": 50,
                    "runs_total": 1,
                    "cut_total": 1,
                }
            ),
            RolloutAdmitted(group="order-18", input={"question": "17 * 23", "answer": "391"}),
            RolloutUpdated(
                group="order-18",
                doc={"task_id": TASK, "admitted": 5, "runs": [], "spent": 0, "closed": False},
            ),
            MatrixAdmitted(
                group="order-19",
                candidates=[
                    PlannedCandidate(
                        name="current",
                        index=0,
                        kind="version",
                        variant=f"version {V1}",
                        workflow_version=V1,
                        control=True,
                        implicit=True,
                        samples=3,
                        max_model_calls=10,
                    )
                ],
                definitions={V1: {"id": "arith"}},
                estimate=MatrixEstimate(model_calls=30, replay_calls=30),
            ),
        ],
    ),
    "verify": (
        VERIFY_EVENTS,
        [
            RunVerdictRecorded(run_id=RUN, passed=False, results=[RESULT, RESULT]),
            RunVerdictRecorded(run_id=RUN, passed=True, results=[RESULT], branch=3),
            VerificationStopped(run_id=RUN, branch=1, reason="wrong input"),
            COMPACTED,
        ],
    ),
    "tournament": (
        TOURNAMENT_EVENTS,
        [
            COMPACTED,
            ReferenceSet(
                task_id=TASK, workflow_version=V1, run_id=RUN, episode="blob:abc", passed=True
            ),
            ChallengerParked(verified=VERIFIED.model_dump(mode="json")),
            EpisodeSummarised(original="blob:abc", summary="blob:def"),
            *[
                RunScored(
                    run_id=RUN,
                    task_id=TASK,
                    workflow_version=V2,
                    score=score,
                    judge_calls=1,
                    order_index=3,
                    was_parked=True,
                )
                for score in SCORES
            ],
            GroupJoined(
                task_id=TASK,
                passed=True,
                epoch=2,
                opened_ms=1_700_000_000_000,
                quorum=8,
                timeout_s=3600.0,
                members=3,
                member=VERIFIED.model_dump(mode="json"),
            ),
            GroupClosed(
                task_id=TASK,
                passed=True,
                epoch=2,
                runs=[RUN, OTHER_RUN],
                on_timeout=True,
                judge_calls=4,
                inconsistent=1,
                anchored=True,
            ),
            GradingMetered(
                meter={"day": "2026-11-29", "calls_today": 12, "by_purpose": {"compare": 12}}
            ),
            SiblingWaiting(group="order-18", verified=VERIFIED.model_dump(mode="json")),
            RolloutSelected(group="order-18", result={"winner": RUN, "passes": 1}),
            JudgeAnswered(key=f"order-18/{RUN}/{OTHER_RUN}", verdict="b"),
            JudgeAnswered(key=f"order-18/{RUN}", violations=[]),
            ReplaySpent(run_id=OTHER_RUN, day="2026-11-29", model_calls=1, tokens=12),
            CalibrationEpisodeKept(
                workflow_id=WF,
                task_id=TASK,
                passed=False,
                run_id=OTHER_RUN,
                episode="blob:fail",
                completes=True,
            ),
            CalibrationRan(
                found=CALIBRATED.model_dump(mode="json"),
                day="2026-11-29",
                calls_today=6,
                next_due_ms=1_764_627_600_000,
            ),
            GradingStopped(run_id=RUN, branch=2, task_id=TASK, reason="wrong input"),
            ResultIssued(run_id=RUN, branch=2, result={"run_id": RUN, "branch": 2}),
        ],
    ),
    "aggregate": (
        AGGREGATE_EVENTS,
        [
            COMPACTED,
            VersionTallied(
                run_id=RUN,
                workflow_id=WF,
                workflow_version=V2,
                runs=7,
                passes=5,
                baseline_version=V1,
                record=RECORD,
            ),
            VersionTallied(run_id=RUN, workflow_id=WF, workflow_version=V1, runs=1, passes=0),
            VersionTallied(
                run_id=RUN,
                workflow_id=WF,
                workflow_version=V2,
                runs=9,
                passes=7,
                baseline_version=V1,
                record=RECORD,
                screened=6,
                served=2,
                order_checked=3,
                order_inconsistent=1,
                held_out={"runs": 2, "passes": 2, "record": RECORD.model_dump(), "ranked": None},
            ),
            FailuresKept(workflow_version=V1, failures=[FAILURE]),
        ],
    ),
    "decide": (
        DECIDE_EVENTS,
        [
            AllocationSet(allocation=ALLOCATION, expected_generation=1, cause="registered"),
            AllocationSet(
                allocation=ALLOCATION,
                expected_generation=1,
                cause="trial: clean",
                standing=Standing(
                    ladder=Ladder.DEFAULT, rung=Rung.TRIAL, share=0.05, entered_served=2
                ),
            ),
            ChallengerDecided(
                workflow_id=WF,
                workflow_version=V2,
                accepted=True,
                record=RECORD,
                llr=2.94,
                reason="accept boundary",
                outcome="promoted",
                ladder=Ladder.DEFAULT,
                rung=Rung.TRIAL,
                trigger=None,
            ),
            ChallengerDecided(
                workflow_id=WF,
                workflow_version=V2,
                accepted=False,
                record=RECORD,
                llr=0.3,
                reason="1 Core violation",
                outcome="rolled_back",
                ladder=Ladder.RESOURCED,
                rung=Rung.SHADOW,
                trigger="capped",
            ),
            EvidenceAccepted(
                workflow_id=WF, workflow_version=V2, record=RECORD, llr=2.94, reason="accept"
            ),
            PromotionHeld(workflow_id=WF, workflow_version=V2, reason="judge inconsistent"),
            PromotionHeld(workflow_id=WF, workflow_version=V2, reason=None),
            JudgeHealthNoted(calibration=CALIBRATED),
            ProposalMade(proposal=PROPOSAL, failures=[FAILURE]),
            ProposalNotMade(
                workflow_id=WF,
                after=V2,
                proposer="catalog",
                reason="nothing left to propose from 3 selection-set failure(s)",
                usage=Usage(),
            ),
            ProposalReviewed(
                workflow_id=WF,
                proposal_id="0123456789abcdef",
                approved=False,
                reason="keep prompts short",
                by="operator",
            ),
        ],
    ),
}

FIXTURES = Path(__file__).resolve().parents[3] / "tests" / "fixtures"


def _from_fixture(registry: EventRegistry, stage: str, type_: str) -> Event:
    """An example read from the stage's golden fixture of `type_`'s current version."""
    model = registry.types()[type_]
    path = FIXTURES / "events" / stage / f"{type_}.v{model.version}.json"
    return registry.decode(type_, model.version, json.loads(path.read_text()))


# Every stage's log can hold a tenant's tombstone; the task-mix watch's records.
for _stage_examples in EVENT_EXAMPLES.values():
    _stage_examples[1].append(TenantErased(command="0f3a9c2e5b7d4a1c", reason="contract ended"))
for _fixture_stage, _fixture_types in {
    "ingest": ("TaskMixSampled", "TaskMixReferenced", "TaskMixMeasured", "TaskMixReset"),
    "decide": ("TaskMixHeld", "TaskMixReleased"),
}.items():
    EVENT_EXAMPLES[_fixture_stage][1].extend(
        _from_fixture(EVENT_EXAMPLES[_fixture_stage][0], _fixture_stage, t) for t in _fixture_types
    )
for _message_type in ("TaskMixDrifted", "TaskMixRebased", "AcknowledgeDrift"):
    _message_model = MESSAGES.types()[_message_type]
    _message_path = FIXTURES / "messages" / f"{_message_type}.v{_message_model.version}.json"
    MESSAGE_EXAMPLES.append(
        MESSAGES.decode(
            _message_type, _message_model.version, json.loads(_message_path.read_text())
        )
    )


def _round_trip(registry: SchemaRegistry[Any], msg: Versioned) -> Versioned:
    wire = json.loads(json.dumps(msg.model_dump(mode="json")))
    decoded: Versioned = registry.decode(msg.type, msg.version, wire)
    return decoded


def test_message_examples_cover_every_registered_message_type() -> None:
    assert {m.type for m in MESSAGE_EXAMPLES} == set(MESSAGES.types())
    assert all(MESSAGES.types()[m.type] is type(m) for m in MESSAGE_EXAMPLES)


@pytest.mark.parametrize(
    "msg", MESSAGE_EXAMPLES, ids=[f"{m.type}-{i}" for i, m in enumerate(MESSAGE_EXAMPLES)]
)
def test_every_message_type_round_trips_through_json_and_the_registry(msg: Versioned) -> None:
    decoded = _round_trip(MESSAGES, msg)
    assert decoded == msg
    assert type(decoded) is type(msg)
    assert decoded.model_dump(mode="json") == msg.model_dump(mode="json")


def test_a_usage_recorded_v1_payload_upcasts_to_v2_costing_nothing() -> None:
    v1 = {
        "tenant": str(TENANT),
        "run_id": str(RUN),
        "purpose": "work",
        "model": "stub",
        "prompt_tokens": 3,
        "completion_tokens": 7,
    }
    decoded = MESSAGES.decode("UsageRecorded", 1, v1)
    assert isinstance(decoded, UsageRecorded)
    assert decoded.cost_usd == 0.0
    assert (decoded.prompt_tokens, decoded.completion_tokens) == (3, 7)
    assert MESSAGES.versions("UsageRecorded") == [1, 2, 3, 4]
    with pytest.raises(UnknownSchema, match="cost_usd"):
        MESSAGES.decode("UsageRecorded", 2, v1)  # v2 states its cost; nothing guesses it


@pytest.mark.parametrize(
    ("type_", "version"),
    [
        ("RunExecuted", 2),
        ("RunVerified", 2),
        ("RolloutProgress", 1),
        ("RolloutClosed", 1),
        ("RolloutResult", 1),
    ],
)
def test_a_message_from_before_costs_were_carried_upcasts_costing_nothing(
    type_: str, version: int
) -> None:
    current = next(m for m in MESSAGE_EXAMPLES if m.type == type_ and m.cost_usd > 0)  # type: ignore[attr-defined]
    old = current.model_dump(mode="json")
    del old["cost_usd"]
    decoded = MESSAGES.decode(type_, version, old)
    assert decoded.cost_usd == 0.0  # type: ignore[attr-defined]
    assert decoded.model_dump(mode="json") == {**old, "cost_usd": 0.0}


def test_a_task_submitted_v2_reads_as_v3_without_a_cost_cap() -> None:
    v2 = {
        "tenant": str(TENANT),
        "workflow_id": WF,
        "idempotency_key": "order-18",
        "input": {"question": "17 * 23"},
        "task_key": None,
        "rollout": {"n": 2, "budget": {"run_max_tokens": 100, "group_max_tokens": 200}},
    }
    decoded = MESSAGES.decode("TaskSubmitted", 2, v2)
    assert isinstance(decoded, TaskSubmitted)
    assert decoded.rollout is not None
    assert decoded.rollout.budget.run_max_cost_usd is None
    assert decoded.rollout.budget.group_max_cost_usd is None


def test_a_sibling_without_a_cost_cap_serialises_as_before() -> None:
    ref = SIBLING.model_copy(
        update={"rollout": SIBLING.rollout.model_copy(update={"max_cost_usd": None})}  # type: ignore[union-attr]
    )
    assert "max_cost_usd" not in ref.model_dump(mode="json")["rollout"]
    assert SIBLING.model_dump(mode="json")["rollout"]["max_cost_usd"] == 0.002


@pytest.mark.parametrize("cost", [-0.01, float("nan"), float("inf")])
def test_a_usage_recorded_cost_is_finite_and_not_negative(cost: float) -> None:
    with pytest.raises(ValueError, match="cost_usd"):
        UsageRecorded(
            tenant=TENANT,
            run_id=RUN,
            purpose=Purpose.WORK,
            model="stub",
            prompt_tokens=1,
            completion_tokens=1,
            cost_usd=cost,
        )


@pytest.mark.parametrize("stage", sorted(EVENT_EXAMPLES))
def test_event_examples_cover_every_event_type_of_each_stage(stage: str) -> None:
    registry, examples = EVENT_EXAMPLES[stage]
    assert {e.type for e in examples} == set(registry.types())


@pytest.mark.parametrize(
    ("stage", "event"),
    [(stage, e) for stage, (_, events) in sorted(EVENT_EXAMPLES.items()) for e in events],
    ids=[f"{s}-{e.type}" for s, (_, events) in sorted(EVENT_EXAMPLES.items()) for e in events],
)
def test_every_event_type_of_every_stage_round_trips(stage: str, event: Event) -> None:
    registry = EVENT_EXAMPLES[stage][0]
    decoded = _round_trip(registry, event)
    assert decoded == event
    assert type(decoded) is type(event)


def test_every_registered_type_writes_a_schema_version_of_at_least_one() -> None:
    registries: list[SchemaRegistry[Any]] = [MESSAGES, *(r for r, _ in EVENT_EXAMPLES.values())]
    for registry in registries:
        for name, model in registry.types().items():
            assert model.type == name
            assert isinstance(model.version, int)
            assert model.version >= 1
            assert registry.versions(name)[-1] == model.version


def test_a_run_result_v3_upcasts_to_v4_not_saying_whether_its_task_was_held_out() -> None:
    v3 = json.loads(
        (Path(__file__).parents[3] / "tests/fixtures/messages/RunResult.v3.json").read_text()
    )
    decoded = MESSAGES.decode("RunResult", 3, v3)
    assert isinstance(decoded, RunResult)
    assert decoded.held_out is None  # unknown, never guessed as a selection task
    with pytest.raises(UnknownSchema, match="held_out"):
        MESSAGES.decode("RunResult", 4, v3)  # v4 says, one way or the other
