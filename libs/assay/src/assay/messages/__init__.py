"""Wire contracts: the envelope and every message payload (DESIGN §4–§5)."""

from assay.kernel.schema import SchemaRegistry, UnknownSchema, Versioned
from assay.messages.branching import (
    BranchChild,
    BranchChildResult,
    BranchDelta,
    BranchRun,
    BranchTree,
    InjectPlanDelta,
    ModelParamsDelta,
    PromptDelta,
    ToolUnavailableDelta,
)
from assay.messages.envelope import (
    MAX_MESSAGE_BYTES,
    Envelope,
    message_id,
    open_envelope,
    seal,
    traceparent_for,
)
from assay.messages.episode import AttemptView, Elision, Episode, ReducedEpisode
from assay.messages.loop import (
    AllocationChanged,
    ChallengerRejected,
    HeldOutTally,
    Ladder,
    Promoted,
    RolledBack,
    Rung,
    StrengthSummary,
    VariantAggregate,
    allocation_changed_v1_to_v2,
    variant_aggregate_v1_to_v2,
    variant_aggregate_v2_to_v3,
    variant_aggregate_v3_to_v4,
)
from assay.messages.models import (
    AttemptIndeterminate,
    CancelRun,
    GroupDue,
    JudgePurpose,
    Purpose,
    RewindRun,
    Role,
    RunExecuted,
    RunGraded,
    RunRef,
    RunResult,
    RunSpawned,
    RunStatusChanged,
    RunVerified,
    SignalRun,
    TaskSubmitted,
    Usage,
    UsageRecorded,
    VerifierResult,
    WorkflowRegistered,
    run_cost_unknown,
    run_graded_v1_to_v2,
    run_graded_v3_to_v4,
    run_graded_v5_to_v6,
    run_ref_unchanged,
    run_ref_v2_unchanged,
    run_result_v1_to_v2,
    run_result_v2_to_v3,
    run_result_v3_to_v4,
    run_result_v4_to_v5,
    run_spawned_v1_to_v2,
    task_submitted_v1_to_v2,
    task_submitted_v2_to_v3,
    usage_recorded_v1_to_v2,
    usage_recorded_v2_to_v3,
    workflow_registered_v1_to_v2,
)
from assay.messages.proposals import (
    FailureEvidence,
    ProposalRequested,
    ReviewProposal,
)
from assay.messages.rollout_spec import (
    RolloutBudget,
    RolloutRef,
    RolloutSpec,
    SelectionPolicy,
)
from assay.messages.rollouts import (
    CancelRollout,
    RolloutClosed,
    RolloutProgress,
    RolloutResult,
    SelectionRecord,
    SiblingResult,
    rollout_cost_unknown,
    rollout_result_v2_to_v3,
)

MESSAGES: SchemaRegistry[Versioned] = SchemaRegistry(
    [
        TaskSubmitted,
        WorkflowRegistered,
        RunSpawned,
        RunStatusChanged,
        AttemptIndeterminate,
        RunExecuted,
        RunVerified,
        GroupDue,
        RunGraded,
        RunResult,
        RolloutProgress,
        CancelRollout,
        RolloutClosed,
        RolloutResult,
        CancelRun,
        RewindRun,
        BranchRun,
        SignalRun,
        VariantAggregate,
        AllocationChanged,
        Promoted,
        ChallengerRejected,
        RolledBack,
        ProposalRequested,
        ReviewProposal,
        UsageRecorded,
    ]
)
"""Every message type that travels on a topic, at its current version."""

MESSAGES.upcaster("UsageRecorded", 1)(usage_recorded_v1_to_v2)
MESSAGES.upcaster("TaskSubmitted", 1)(task_submitted_v1_to_v2)
MESSAGES.upcaster("RunSpawned", 2)(run_ref_unchanged)
MESSAGES.upcaster("RunStatusChanged", 1)(run_ref_unchanged)
MESSAGES.upcaster("AttemptIndeterminate", 1)(run_ref_unchanged)
MESSAGES.upcaster("RunExecuted", 1)(run_ref_unchanged)
MESSAGES.upcaster("RunVerified", 1)(run_ref_unchanged)
MESSAGES.upcaster("RunGraded", 2)(run_ref_unchanged)
MESSAGES.upcaster("RunResult", 1)(run_result_v1_to_v2)
MESSAGES.upcaster("RunResult", 2)(run_result_v2_to_v3)
MESSAGES.upcaster("RunResult", 3)(run_result_v3_to_v4)
MESSAGES.upcaster("RunGraded", 1)(run_graded_v1_to_v2)
MESSAGES.upcaster("RunGraded", 3)(run_graded_v3_to_v4)
MESSAGES.upcaster("VariantAggregate", 1)(variant_aggregate_v1_to_v2)
MESSAGES.upcaster("VariantAggregate", 2)(variant_aggregate_v2_to_v3)
MESSAGES.upcaster("VariantAggregate", 3)(variant_aggregate_v3_to_v4)
MESSAGES.upcaster("AllocationChanged", 1)(allocation_changed_v1_to_v2)
MESSAGES.upcaster("WorkflowRegistered", 1)(workflow_registered_v1_to_v2)
MESSAGES.upcaster("RunSpawned", 1)(run_spawned_v1_to_v2)
MESSAGES.upcaster("TaskSubmitted", 2)(task_submitted_v2_to_v3)
MESSAGES.upcaster("RunSpawned", 3)(run_ref_v2_unchanged)
MESSAGES.upcaster("RunStatusChanged", 2)(run_ref_v2_unchanged)
MESSAGES.upcaster("AttemptIndeterminate", 2)(run_ref_v2_unchanged)
MESSAGES.upcaster("RunGraded", 4)(run_ref_v2_unchanged)
MESSAGES.upcaster("RunExecuted", 2)(run_cost_unknown)
MESSAGES.upcaster("RunVerified", 2)(run_cost_unknown)
MESSAGES.upcaster("RolloutProgress", 1)(rollout_cost_unknown)
MESSAGES.upcaster("RolloutClosed", 1)(rollout_cost_unknown)
MESSAGES.upcaster("RolloutResult", 1)(rollout_cost_unknown)
MESSAGES.upcaster("UsageRecorded", 2)(usage_recorded_v2_to_v3)
MESSAGES.upcaster("RunGraded", 5)(run_graded_v5_to_v6)
MESSAGES.upcaster("RunResult", 4)(run_result_v4_to_v5)
MESSAGES.upcaster("RolloutResult", 2)(rollout_result_v2_to_v3)

__all__ = [
    "MAX_MESSAGE_BYTES",
    "MESSAGES",
    "AllocationChanged",
    "AttemptIndeterminate",
    "AttemptView",
    "BranchChild",
    "BranchChildResult",
    "BranchDelta",
    "BranchRun",
    "BranchTree",
    "CancelRollout",
    "CancelRun",
    "ChallengerRejected",
    "Elision",
    "Envelope",
    "Episode",
    "FailureEvidence",
    "GroupDue",
    "HeldOutTally",
    "InjectPlanDelta",
    "JudgePurpose",
    "Ladder",
    "ModelParamsDelta",
    "Promoted",
    "PromptDelta",
    "ProposalRequested",
    "Purpose",
    "ReducedEpisode",
    "ReviewProposal",
    "RewindRun",
    "Role",
    "RolledBack",
    "RolloutBudget",
    "RolloutClosed",
    "RolloutProgress",
    "RolloutRef",
    "RolloutResult",
    "RolloutSpec",
    "RunExecuted",
    "RunGraded",
    "RunRef",
    "RunResult",
    "RunSpawned",
    "RunStatusChanged",
    "RunVerified",
    "Rung",
    "SchemaRegistry",
    "SelectionPolicy",
    "SelectionRecord",
    "SiblingResult",
    "SignalRun",
    "StrengthSummary",
    "TaskSubmitted",
    "ToolUnavailableDelta",
    "UnknownSchema",
    "Usage",
    "UsageRecorded",
    "VariantAggregate",
    "VerifierResult",
    "Versioned",
    "WorkflowRegistered",
    "message_id",
    "open_envelope",
    "seal",
    "traceparent_for",
]
