"""The console API's answers about workflows: the list, and one workflow's ladder (its
version DAG, allocations, challengers' evidence, decisions and proposals). Every field is
described, so the OpenAPI document reads as documentation.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from assay.kernel.scores import WinRecord


class LiveShare(BaseModel):
    """A live challenger as the workflows list shows it."""

    version: str = Field(description="The challenger.")
    rung: str = Field(description="Its rung.")
    share: float = Field(description="Its share of live tasks.")


class WorkflowSummary(BaseModel):
    """One row of the workflows list."""

    workflow_id: str = Field(description="The workflow.")
    current: str | None = Field(description="Its current version.")
    challenger: str | None = Field(description="Its (first) challenger, if any.")
    rung: str | None = Field(description="The (first) challenger's rung.")
    share: float = Field(description="Share of live tasks the (first) challenger serves.")
    generation: int = Field(description="The allocation's generation.")
    latest: str | None = Field(description="The version registered last.")
    updated: datetime | None = Field(description="When the ladder last moved.")
    challengers: list[LiveShare] = Field(
        description="Every live challenger, in the order admitted, with its rung and share."
    )


class WorkflowsList(BaseModel):
    """A tenant's workflows, by id."""

    workflows: list[WorkflowSummary] = Field(description="The workflows.")


class VersionNode(BaseModel):
    """A version in the DAG."""

    version: str = Field(description="The version (blake3 of its IR).")
    parents: list[str] = Field(description="The versions it derives from.")
    registered_at: datetime | None = Field(description="When it was registered (None: unseen).")
    description: str = Field(description="The definition's description.")
    grading: str | None = Field(description="Its grading strategy.")
    proposal: str | None = Field(description="The proposal it came from, if any.")
    status: str = Field(
        description=(
            "current, challenger, retired (was current, since replaced), rejected, "
            "rolled_back, proposed (waiting for an operator), proposal_rejected, or "
            "registered."
        )
    )


class RungEntry(BaseModel):
    """One allocation: where the ladder stood from `at`."""

    at: datetime = Field(description="When decide published it.")
    generation: int = Field(description="Its generation.")
    current: str = Field(description="Current version.")
    challenger: str | None = Field(description="The (first) challenger.")
    rung: str | None = Field(description="The (first) challenger's rung.")
    share: float = Field(description="Share of live tasks the (first) challenger serves.")
    shares: dict[str, float] = Field(
        description="Each live version's share of live tasks (summing to 1)."
    )


class SprtPoint(BaseModel):
    """The test after a comparison."""

    comparisons: int = Field(description="Comparisons so far, draws included.")
    wins: int = Field(description="Wins so far, judge and verifier.")
    losses: int = Field(description="Losses so far, judge and verifier.")
    draws: int = Field(description="Draws so far (they do not move the ratio).")
    llr: float = Field(description="Log-likelihood ratio after it.")
    at: datetime = Field(description="When the evidence was published.")
    policy_changed: bool = Field(
        description="Computed under another policy than the latest point (draw it apart)."
    )


class SprtPath(BaseModel):
    """The sequential test's path between its boundaries."""

    p0: float = Field(description="Win rate under H0.")
    p1: float = Field(description="Win rate under H1.")
    alpha: float = Field(description="False-accept rate.")
    beta: float = Field(description="False-reject rate.")
    upper: float = Field(description="Accept boundary.")
    lower: float = Field(description="Reject boundary.")
    points: list[SprtPoint] = Field(description="The ratio after each comparison, from 0.")
    decision: Literal["accept", "reject", "continue"] = Field(
        description="Where the latest point stands."
    )


class HeldOut(BaseModel):
    """The challenger on held-out tasks (no gate reads these)."""

    runs: int = Field(description="Graded runs.")
    passes: int = Field(description="Of which passed.")
    pass_rate: float | None = Field(description="passes / runs.")
    record: WinRecord = Field(description="Its record on held-out tasks.")


class Strength(BaseModel):
    """A strength from control with its interval: a row of the forest plot."""

    label: str = Field(description="What it measures.")
    version: str = Field(description="The version.")
    tasks: Literal["selection", "held_out"] = Field(description="Which tasks.")
    mean: float = Field(description="Mean delta from control.")
    low: float = Field(description="Lower end of the 95% interval.")
    high: float = Field(description="Upper end of the 95% interval.")
    episodes: int = Field(description="Anchored episodes it rests on.")


class Challenger(BaseModel):
    """A challenger's evidence against its baseline, as last published."""

    version: str = Field(description="The challenger.")
    baseline: str = Field(description="The current version it is compared with.")
    live: bool = Field(description="It is the workflow's challenger now.")
    outcome: str | None = Field(
        description=(
            "promoted, rejected or rolled_back; None: live. An ended challenger's figures "
            "and path stop at its decision."
        )
    )
    record: WinRecord = Field(description="Record on selection tasks (judge, verifier apart).")
    runs: int = Field(description="Graded runs on selection tasks.")
    passes: int = Field(description="Of which passed.")
    pass_rate: float | None = Field(description="Selection pass rate.")
    baseline_pass_rate: float | None = Field(description="The baseline's selection pass rate.")
    held_out: HeldOut | None = Field(description="On held-out tasks.")
    gap: float | None = Field(description="Selection minus held-out pass rate.")
    order_checked: int = Field(description="Comparisons asked again, positions swapped.")
    order_inconsistent: int = Field(description="Of which the judge did not mirror itself.")
    sprt: SprtPath = Field(description="The sequential test's path.")
    strengths: list[Strength] = Field(description="Strengths from control (Ranked grading).")


class DecisionEntry(BaseModel):
    """How a challenger's time ended."""

    at: datetime = Field(description="When.")
    version: str = Field(description="The challenger.")
    outcome: str = Field(description="promoted, rejected or rolled_back.")
    reason: str = Field(description="Why.")
    trigger: str | None = Field(description="What rolled it back (capped, pass_rate).")
    rung: str | None = Field(description="The rung it was rolled back from.")
    llr: float | None = Field(description="Log-likelihood ratio at the decision.")
    record: WinRecord = Field(description="The record at the decision.")


class ProposalEntry(BaseModel):
    """A version the slow loop proposed."""

    proposal_id: str = Field(description="The proposal.")
    at: datetime = Field(description="When.")
    version: str = Field(description="The proposed version.")
    parent: str = Field(description="The version it derives from.")
    after: str = Field(description="The challenger whose end triggered it.")
    rationale: str = Field(description="Why the proposer expects it to do better.")
    proposer: str = Field(description="Which proposer drafted it.")
    evidence: int = Field(description="Failures it read.")
    status: Literal["pending", "approved", "rejected"] = Field(description="Where it stands.")
    review: str | None = Field(description="The reviewer's reason.")


class WorkflowDetail(BaseModel):
    """One workflow's ladder."""

    workflow: WorkflowSummary = Field(description="The workflow's row.")
    versions: list[VersionNode] = Field(description="The version DAG, in registration order.")
    rungs: list[RungEntry] = Field(description="Every allocation, oldest first.")
    challengers: list[Challenger] = Field(description="Every challenger's evidence, oldest first.")
    decisions: list[DecisionEntry] = Field(description="Rollbacks, rejections and promotions.")
    proposals: list[ProposalEntry] = Field(description="The slow loop's proposals.")


class ProposalView(BaseModel):
    """A proposal of the slow loop, and where its review stands."""

    proposal_id: str = Field(description="The proposal (16 hex digits).")
    workflow_id: str = Field(description="Its workflow.")
    at: datetime | None = Field(description="When it was proposed (None: not seen yet).")
    version: str | None = Field(description="The proposed version.")
    parent: str | None = Field(description="The version it derives from.")
    after: str | None = Field(description="The challenger whose end triggered it.")
    rationale: str = Field(description="Why the proposer expects it to do better.")
    proposer: str = Field(description="Which proposer drafted it.")
    evidence: int = Field(description="Failures it read.")
    status: Literal["pending", "approved", "rejected"] = Field(description="Where it stands.")
    review: str | None = Field(description="The reviewer's reason.")
    reviewed_at: datetime | None = Field(description="When it was reviewed.")


class ProposalsList(BaseModel):
    """A tenant's open proposals: waiting for an operator's review, oldest first."""

    proposals: list[ProposalView] = Field(description="The open proposals.")
