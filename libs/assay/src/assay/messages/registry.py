"""The registry of every message type that travels on a topic, and their upcasters.

Built on first use of `assay.messages.MESSAGES`: a process that reads one message
type's model does not pay for building the registry.
"""

from assay.kernel.schema import SchemaRegistry, Versioned
from assay.messages.branching import BranchRun
from assay.messages.calibration import CalibrationDue, JudgeCalibrated
from assay.messages.loop import (
    AllocationChanged,
    ChallengerRejected,
    Promoted,
    RolledBack,
    VariantAggregate,
    allocation_changed_v1_to_v2,
    allocation_changed_v2_to_v3,
    variant_aggregate_v1_to_v2,
    variant_aggregate_v2_to_v3,
    variant_aggregate_v3_to_v4,
)
from assay.messages.models import (
    AttemptIndeterminate,
    CancelGrading,
    CancelRun,
    EpisodeReduced,
    GradingCancelled,
    GroupDue,
    RewindRun,
    RunExecuted,
    RunGraded,
    RunResult,
    RunSpawned,
    RunStatusChanged,
    RunVerified,
    SignalRun,
    TaskSubmitted,
    UsageRecorded,
    WorkflowRegistered,
    episode_not_inline,
    run_cost_unknown,
    run_graded_v1_to_v2,
    run_graded_v3_to_v4,
    run_graded_v5_to_v6,
    run_graded_v7_to_v8,
    run_graded_v8_to_v9,
    run_ref_unchanged,
    run_ref_v2_unchanged,
    run_ref_v3_unchanged,
    run_result_v1_to_v2,
    run_result_v2_to_v3,
    run_result_v3_to_v4,
    run_result_v4_to_v5,
    run_result_v5_to_v6,
    run_spawned_v1_to_v2,
    task_submitted_v1_to_v2,
    task_submitted_v2_to_v3,
    task_submitted_v3_to_v4,
    task_submitted_v4_to_v5,
    usage_recorded_v1_to_v2,
    usage_recorded_v2_to_v3,
    usage_recorded_v3_to_v4,
    workflow_registered_v1_to_v2,
)
from assay.messages.proposals import (
    ProposalRequested,
    ReviewProposal,
)
from assay.messages.rollouts import (
    CancelRollout,
    RolloutClosed,
    RolloutProgress,
    RolloutResult,
    rollout_cost_unknown,
    rollout_homogeneous,
    rollout_one_sample,
    rollout_result_v2_to_v3,
)
from assay.messages.task_mix import AcknowledgeDrift, TaskMixDrifted, TaskMixRebased
from assay.messages.tenants import TenantDeleted, TenantStageDeleted

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
        CalibrationDue,
        RunGraded,
        RunResult,
        RolloutProgress,
        CancelRollout,
        RolloutClosed,
        RolloutResult,
        CancelRun,
        CancelGrading,
        GradingCancelled,
        EpisodeReduced,
        RewindRun,
        BranchRun,
        SignalRun,
        VariantAggregate,
        JudgeCalibrated,
        AllocationChanged,
        Promoted,
        ChallengerRejected,
        RolledBack,
        ProposalRequested,
        ReviewProposal,
        TaskMixDrifted,
        TaskMixRebased,
        AcknowledgeDrift,
        UsageRecorded,
        TenantDeleted,
        TenantStageDeleted,
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
MESSAGES.upcaster("AllocationChanged", 2)(allocation_changed_v2_to_v3)
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
MESSAGES.upcaster("UsageRecorded", 3)(usage_recorded_v3_to_v4)
MESSAGES.upcaster("RunGraded", 5)(run_graded_v5_to_v6)
MESSAGES.upcaster("RunResult", 4)(run_result_v4_to_v5)
MESSAGES.upcaster("RolloutResult", 2)(rollout_result_v2_to_v3)
MESSAGES.upcaster("RolloutClosed", 2)(rollout_homogeneous)
MESSAGES.upcaster("RolloutResult", 3)(rollout_homogeneous)
MESSAGES.upcaster("TaskSubmitted", 3)(task_submitted_v3_to_v4)
MESSAGES.upcaster("TaskSubmitted", 4)(task_submitted_v4_to_v5)
MESSAGES.upcaster("RolloutClosed", 3)(rollout_one_sample)
MESSAGES.upcaster("RolloutResult", 4)(rollout_one_sample)
MESSAGES.upcaster("RunResult", 5)(run_result_v5_to_v6)
MESSAGES.upcaster("RunGraded", 7)(run_graded_v7_to_v8)
MESSAGES.upcaster("RunGraded", 8)(run_graded_v8_to_v9)
for _carrier, _before in (
    ("RunSpawned", 4),
    ("RunStatusChanged", 3),
    ("AttemptIndeterminate", 3),
    ("RunExecuted", 3),
    ("RunVerified", 3),
    ("RunGraded", 6),
):
    MESSAGES.upcaster(_carrier, _before)(run_ref_v3_unchanged)
MESSAGES.upcaster("RunExecuted", 4)(episode_not_inline)
MESSAGES.upcaster("RunVerified", 4)(episode_not_inline)
