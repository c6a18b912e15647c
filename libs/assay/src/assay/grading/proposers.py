"""The slow loop's generator (§12.1): a `Proposer` drafts the next version of a workflow.

Decide asks for a proposal when a challenger's time ends without a replacement. The
proposer reads the current version, the challenger that just failed to replace it,
why it failed, and **selection-set failures only** (§12.5: a proposer that reads
held-out failures contaminates the held-out set through the generator). It returns
a whole new definition of the same workflow, or None when it has nothing left to
try. Every draft is validated by decide before anyone sees it, and waits for an
operator unless the tenant is ungated.

Two proposers ship:

- `CatalogProposer`, deterministic: a fixed catalog of edits, each applied to the
  current version when the evidence calls for it, first untried one wins. It is
  the proposer of the stub model (and of any deployment that wants no model in its
  generator).
- `ChatProposer` (`chat_proposer`), model-backed: the default whenever a model
  endpoint is configured.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import ConfigDict, Field, field_validator

from assay.grading.spend_ceilings import DailySpendCeilings
from assay.kernel.errors import AssayError
from assay.kernel.ids import TenantId, WorkflowId, WorkflowVersion
from assay.kernel.spend import SpendLimit
from assay.kernel.tenant_maps import tenant_keyed, tenant_set
from assay.messages.proposals import FailureEvidence
from assay.workflow import WorkflowDef, WorkflowInvalid, from_document

MAX_ATTEMPTS_PROPOSED = 5
"""The most attempts the catalog gives a step."""
MAX_TIMEOUT_PROPOSED_S = 600.0
"""The longest per-attempt timeout the catalog gives a step."""


class ProposerFailed(AssayError):
    """The proposer could not draft a usable version: its model failed, or answered
    with something that is not a valid definition of the workflow. Recorded by decide
    as a proposal not made, with this reason; never retried in a loop."""

    def __init__(self, reason: str, usage: ProposerUsage | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.usage = usage or ProposerUsage()


@dataclass(frozen=True)
class ProposerUsage:
    """What drafting cost: model calls and tokens (all zero for the catalog)."""

    model_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0


@dataclass(frozen=True)
class ProposalInput:
    """What a proposer may read.

    Attributes:
        tenant: whose workflow.
        workflow_id: the workflow.
        current: the current version: what a proposal derives from.
        ended: the challenger whose time just ended, when it is known.
        outcome: how it ended (`rejected`, `rolled_back`, or `proposal_rejected` when an
            operator turned the previous proposal down).
        reason: why it ended, as decide recorded it.
        failures: selection-set failures of the current version and the challenger.
        tried: every version decide has held or turned away: never proposed again.
        feedback: the reasons operators gave for rejecting earlier proposals.
    """

    tenant: TenantId
    workflow_id: WorkflowId
    current: WorkflowDef
    ended: WorkflowDef | None
    outcome: str
    reason: str
    failures: list[FailureEvidence]
    tried: frozenset[WorkflowVersion]
    feedback: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Proposal:
    """A drafted version and why the proposer expects it to do better."""

    definition: WorkflowDef
    rationale: str
    usage: ProposerUsage = field(default_factory=ProposerUsage)


class ProposalPolicy(DailySpendCeilings):
    """Whose proposals skip the operator (§16: the generator is gated by default; a
    tenant ungates it explicitly, once its loop is calibrated), and the proposer's
    ceilings per tenant per UTC day in calls, tokens and dollars (§14.1): decide
    reserves a draft's worst case against them before asking the proposer."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ungated: frozenset[str] = Field(
        frozenset(),
        description="Tenants whose proposals skip approval: UUIDs, comma separated.",
    )
    calls_per_day: int | None = Field(
        None, ge=0, description="Proposer model calls per tenant per UTC day (unset: no limit)."
    )
    ceilings: dict[str, int] = Field(
        default_factory=dict, description="Per-tenant call ceilings: `<tenant-uuid>=<calls>,...`."
    )

    @field_validator("ungated", mode="before")
    @classmethod
    def _tenants(cls, value: object) -> object:
        return tenant_set(value)

    @field_validator("ceilings", mode="before")
    @classmethod
    def _calls(cls, value: object) -> object:
        return tenant_keyed(value, "calls")

    def limit_for(self, tenant: str) -> SpendLimit:
        """The tenant's proposer ceiling per UTC day in calls, tokens and dollars."""
        return self.spend_limit(tenant, self.ceilings.get(str(tenant), self.calls_per_day))

    def gated(self, tenant: TenantId) -> bool:
        """Whether `tenant`'s proposals wait for approval."""
        return str(tenant) not in self.ungated


class Proposer(Protocol):
    """Drafts the next version of a workflow from selection-set failures (§12.1)."""

    name: str

    async def propose(self, request: ProposalInput) -> Proposal | None:
        """A new version of `request.current`, or None when there is nothing left to try.

        A proposer that calls a model may also offer `worst_case(request) ->
        ProposerUsage` (what drafting could cost at most): decide reserves it against
        the tenant's proposer ceiling first. Without it a draft is reserved as one call
        of no known tokens or dollars.

        Raises:
            ProposerFailed: drafting failed (the reason says why).
        """
        ...

    async def aclose(self) -> None:
        """Release what the proposer holds."""
        ...


def derived(doc: dict[str, Any], base: WorkflowDef, origin: str) -> WorkflowDef:
    """`doc` as a definition of `base`'s workflow.

    Raises:
        ProposerFailed: it does not parse, or names another workflow.
    """
    try:
        wf = from_document(doc, origin)
    except WorkflowInvalid as exc:
        raise ProposerFailed(f"{origin} is not a valid workflow: {exc}") from exc
    if wf.id != base.id:
        raise ProposerFailed(f"{origin} names workflow {wf.id!r}, not {base.id!r}")
    return wf


@dataclass(frozen=True)
class Edit:
    """One catalog entry: `apply` returns the edited document and what it changed, or
    None when the evidence does not call for it or it changes nothing."""

    name: str
    apply: Callable[[dict[str, Any], ProposalInput], tuple[dict[str, Any], str] | None]


def _model_steps(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in doc["steps"] if s.get("kind") == "model"]


def _wrong_answers(request: ProposalInput) -> bool:
    return any(f.failed_checks for f in request.failures)


def _append_to_prompts(doc: dict[str, Any], present: re.Pattern[str], sentence: str) -> list[str]:
    """Append `sentence` to every model prompt `present` does not match; the step ids."""
    changed = []
    for step in _model_steps(doc):
        if not present.search(step["prompt"]):
            step["prompt"] = f"{step['prompt'].rstrip()} {sentence}"
            changed.append(str(step["id"]))
    return changed


def _reason_step_by_step(
    doc: dict[str, Any], request: ProposalInput
) -> tuple[dict[str, Any], str] | None:
    if not _wrong_answers(request):
        return None
    changed = _append_to_prompts(
        doc, re.compile(r"step[ -]by[ -]step", re.IGNORECASE), "Think step by step."
    )
    if not changed:
        return None
    return doc, f"asks model step(s) {', '.join(changed)} to reason step by step"


def _answer_only(doc: dict[str, Any], request: ProposalInput) -> tuple[dict[str, Any], str] | None:
    if not _wrong_answers(request):
        return None
    changed = _append_to_prompts(
        doc,
        re.compile(r"\bonly the\b", re.IGNORECASE),
        "Reply with only the number or the final answer, nothing else.",
    )
    if not changed:
        return None
    return doc, f"asks model step(s) {', '.join(changed)} for the bare answer"


def _credited(request: ProposalInput, timed_out: bool) -> set[str]:
    """Steps a failed attempt of which a retry turned into a pass (timeouts, or not)."""
    return {
        c.step
        for f in request.failures
        for c in f.step_credit
        if ("timed out" in c.failure.lower() or "timeout" in c.failure.lower()) == timed_out
    }


def _more_attempts(
    doc: dict[str, Any], request: ProposalInput
) -> tuple[dict[str, Any], str] | None:
    steps = _credited(request, timed_out=False) | _credited(request, timed_out=True)
    changed = []
    for step in doc["steps"]:
        if step["id"] in steps and "retry" in step:
            attempts = int(step["retry"].get("max_attempts", 1))
            if attempts < MAX_ATTEMPTS_PROPOSED:
                step["retry"] = {**step["retry"], "max_attempts": attempts + 1}
                changed.append(str(step["id"]))
    if not changed:
        return None
    return (
        doc,
        f"gives step(s) {', '.join(changed)} one more attempt (a retry turned fails into passes)",
    )


def _longer_timeout(
    doc: dict[str, Any], request: ProposalInput
) -> tuple[dict[str, Any], str] | None:
    steps = _credited(request, timed_out=True)
    changed = []
    for step in doc["steps"]:
        if step["id"] in steps and "timeout_s" in step:
            timeout = float(step["timeout_s"])
            if timeout < MAX_TIMEOUT_PROPOSED_S:
                step["timeout_s"] = min(MAX_TIMEOUT_PROPOSED_S, timeout * 2)
                changed.append(str(step["id"]))
    if not changed:
        return None
    return doc, f"doubles the timeout of step(s) {', '.join(changed)} (attempts timed out)"


CATALOG: tuple[Edit, ...] = (
    Edit("reason_step_by_step", _reason_step_by_step),
    Edit("answer_only", _answer_only),
    Edit("more_attempts", _more_attempts),
    Edit("longer_timeout", _longer_timeout),
)
"""The catalog, in the order it is tried."""


class CatalogProposer:
    """The deterministic proposer: the first catalog edit the evidence calls for whose
    result has not been tried, applied to the current version. Same input, same draft."""

    name = "catalog"

    def __init__(self, catalog: tuple[Edit, ...] = CATALOG) -> None:
        self.catalog = catalog

    async def propose(self, request: ProposalInput) -> Proposal | None:
        if not request.failures:
            return None  # nothing to learn from: the loop waits for evidence
        base = request.current.model_dump(mode="json", by_alias=True)
        for edit in self.catalog:
            edited = edit.apply(copy.deepcopy(base), request)
            if edited is None:
                continue
            doc, what = edited
            wf = derived(doc, request.current, f"catalog edit {edit.name!r}")
            if wf.version in request.tried or wf.version == request.current.version:
                continue
            return Proposal(
                wf,
                f"{edit.name}: {what}; from {len(request.failures)} selection-set failure(s)",
            )
        return None

    async def aclose(self) -> None:
        """Nothing to release."""
