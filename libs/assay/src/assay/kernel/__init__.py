"""Kernel: identifiers, closed state machines, canonical hashing. No I/O."""

from assay.kernel.attempts import AttemptState, attempt_transition, legal_attempt_transitions
from assay.kernel.canonical import canonical_bytes, content_hash, digest
from assay.kernel.errors import AssayError, IllegalTransition, Refused
from assay.kernel.ids import (
    AttemptNo,
    BranchId,
    GroupEpoch,
    Lsn,
    MessageId,
    RunId,
    StepId,
    TaskId,
    TenantId,
    WorkflowId,
    WorkflowVersion,
    is_run_id,
    new_run_id,
    run_id_from,
    tenant_id,
)
from assay.kernel.intents import IntentState, intent_transition, legal_intent_transitions
from assay.kernel.lifecycle import RunState, legal_run_transitions, run_transition

__all__ = [
    "AssayError",
    "AttemptNo",
    "AttemptState",
    "BranchId",
    "GroupEpoch",
    "IllegalTransition",
    "IntentState",
    "Lsn",
    "MessageId",
    "Refused",
    "RunId",
    "RunState",
    "StepId",
    "TaskId",
    "TenantId",
    "WorkflowId",
    "WorkflowVersion",
    "attempt_transition",
    "canonical_bytes",
    "content_hash",
    "digest",
    "intent_transition",
    "is_run_id",
    "legal_attempt_transitions",
    "legal_intent_transitions",
    "legal_run_transitions",
    "new_run_id",
    "run_id_from",
    "run_transition",
    "tenant_id",
]
