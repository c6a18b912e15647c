"""The optimisation loop's messages (§12): aggregates in, decisions and allocations out.

Aggregate publishes each challenger's evidence (`VariantAggregate`); decide holds
one current version and at most `grading.challengers` live challengers per workflow
(one by default), moves each challenger along the promotion ladder and publishes
the allocation ingest routes by (`AllocationChanged`) with the decision that moved
it (`Promoted`, `ChallengerRejected`, `RolledBack`).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from assay.kernel.ids import TenantId, WorkflowId, WorkflowVersion
from assay.kernel.schema import Versioned
from assay.kernel.scores import WinRecord
from assay.messages.proposals import FailureEvidence
from assay.messages.rungs import Ladder, Rung

__all__ = [
    "AllocationChanged",
    "ChallengerRejected",
    "HeldOutTally",
    "Ladder",
    "LiveChallenger",
    "Promoted",
    "RolledBack",
    "Rung",
    "StrengthSummary",
    "VariantAggregate",
    "allocation_changed_v1_to_v2",
    "allocation_changed_v2_to_v3",
    "complete_allocation",
    "variant_aggregate_v1_to_v2",
    "variant_aggregate_v2_to_v3",
    "variant_aggregate_v3_to_v4",
]


class StrengthSummary(Versioned):
    """A variant's anchored `Ranked` deltas across groups (§11.2): like-for-like deltas
    from control, so their mean means something. Unanchored groups are counted, never
    averaged in."""

    type: ClassVar[str] = "StrengthSummary"
    version: ClassVar[int] = 1
    episodes: int = Field(ge=0, description="Anchored Ranked scores folded in.")
    mean: float = Field(description="Mean delta from control.")
    interval: tuple[float, float] = Field(
        description="95% interval on the mean (t over episodes; a point with fewer than two)."
    )
    unanchored: int = Field(ge=0, description="Ranked scores from groups without control.")


class HeldOutTally(Versioned):
    """A challenger's measures on held-out tasks (§12.5): reported beside the selection
    evidence so the gap between them shows overfitting, and never read by a gate."""

    type: ClassVar[str] = "HeldOutTally"
    version: ClassVar[int] = 1
    runs: int = Field(ge=0, description="Graded challenger runs on held-out tasks.")
    passes: int = Field(ge=0, description="Of which passed verification.")
    record: WinRecord = Field(description="Its win record on held-out tasks.")
    strength: StrengthSummary | None = Field(
        None, description="Its anchored Ranked deltas on held-out tasks, when it has any."
    )
    baseline_runs: int = Field(ge=0, description="Graded runs of the baseline on held-out tasks.")
    baseline_passes: int = Field(ge=0, description="Of which passed verification.")


class VariantAggregate(Versioned):
    """A challenger's cumulative evidence against its baseline.

    Version 2 adds `strength`: the mean of its anchored `Ranked` deltas, for the
    tournament and deterministic strategies. Version 3 splits the evidence by the
    held-out set: `record`, `runs`, `passes` and `strength` count selection tasks
    only (every task, before the split), and `held_out` reports the rest. It adds
    what the ladder's gates read: `screened` and `served` episodes, the baseline's
    pass rate and the judge's order checks. A `Ranked` delta also counts in the
    record by its sign (a win above control, a loss below, a draw at it), so the
    sequential test runs on every strategy. Version 4 adds `failures`: the most recent
    selection-set failures of the challenger and of its baseline, the evidence the slow
    loop's proposer reads when the challenger's time ends without a replacement.
    """

    type: ClassVar[str] = "VariantAggregate"
    version: ClassVar[int] = 4
    tenant: TenantId = Field(description="Tenant.")
    workflow_id: WorkflowId = Field(description="Workflow.")
    workflow_version: WorkflowVersion = Field(description="The challenger.")
    baseline_version: WorkflowVersion = Field(description="The current version compared with.")
    record: WinRecord = Field(description="Cumulative win record on selection tasks.")
    runs: int = Field(ge=0, description="Graded challenger runs on selection tasks.")
    passes: int = Field(ge=0, description="Of which passed verification.")
    strength: StrengthSummary | None = Field(
        None, description="v2: its anchored Ranked deltas from control, when it has any."
    )
    screened: int = Field(
        0,
        ge=0,
        description=(
            "v3: selection episodes graded without a Core violation (Capped ones are in "
            "`record.capped`; judge failures and spent budgets are not counted)."
        ),
    )
    served: int = Field(
        0, ge=0, description="v3: of the screened episodes, those that served a live task."
    )
    baseline_runs: int = Field(
        0, ge=0, description="v3: graded runs of the baseline on selection tasks."
    )
    baseline_passes: int = Field(0, ge=0, description="v3: of which passed verification.")
    order_checked: int = Field(
        0, ge=0, description="v3: its comparisons asked again with the positions swapped."
    )
    order_inconsistent: int = Field(
        0, ge=0, description="v3: of which the judge did not mirror itself."
    )
    held_out: HeldOutTally | None = Field(
        None, description="v3: the same measures on held-out tasks, when it has run on any."
    )
    failures: list[FailureEvidence] = Field(
        default_factory=list,
        description=(
            "v4: recent selection-set failures of the challenger and of the baseline, newest "
            "last (never a held-out run)."
        ),
    )


class LiveChallenger(BaseModel):
    """One live challenger of an allocation: its version, rung and ladder."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    version: WorkflowVersion = Field(description="The challenger.")
    rung: Rung = Field(description="Its rung.")
    ladder: Ladder = Field(Ladder.DEFAULT, description="The ladder it climbs (by its grading).")


SHARES_TOLERANCE = 1e-9
"""How far from 1 the shares of an allocation may sum (floating point, nothing more)."""


class AllocationChanged(Versioned):
    """Decide's allocation for a workflow; ingest routes new runs by the latest.

    Version 2 adds the challenger's `rung` and the `ladder` it climbs. Version 3 allows
    several live challengers (a tournament-graded workflow's `grading.challengers`):
    `challengers` lists every one in the order they were admitted, and `shares` gives
    every live version's share of live tasks, the current version's included, summing
    to 1. The single-challenger fields (`challenger`, `challenger_share`, `rung`,
    `ladder`) describe the first of `challengers`, as they did, for readers of v2.
    """

    type: ClassVar[str] = "AllocationChanged"
    version: ClassVar[int] = 3
    tenant: TenantId = Field(description="Tenant.")
    workflow_id: WorkflowId = Field(description="Workflow.")
    generation: int = Field(ge=1, description="Compare-and-swap generation; higher wins.")
    current: WorkflowVersion = Field(description="The current version.")
    challenger: WorkflowVersion | None = Field(
        None, description="The (v3: first) challenger, if any."
    )
    challenger_share: float = Field(
        0.0, ge=0, le=1, description="Share of live tasks served by the (v3: first) challenger."
    )
    shadow_rate: float = Field(
        0.0,
        ge=0,
        le=1,
        description=(
            "Share of tasks also re-run under the other version (every challenger's, on a "
            "task the current version serves; the current's, as the reference, on one a "
            "challenger serves)."
        ),
    )
    definitions: dict[str, dict[str, Any]] = Field(
        description="The IR of every version named here, by version."
    )
    rung: Rung | None = Field(
        None, description="v2: the (v3: first) challenger's rung; None without one."
    )
    ladder: Ladder = Field(
        Ladder.DEFAULT, description="v2: the ladder the (v3: first) challenger climbs."
    )
    challengers: list[LiveChallenger] = Field(
        default_factory=list, description="v3: every live challenger, in the order admitted."
    )
    shares: dict[str, float] = Field(
        default_factory=dict,
        description=(
            "v3: each live version's share of live tasks (the current version and every "
            "challenger), summing to 1."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _complete(cls, data: Any) -> Any:
        """Fill what one form leaves out from the other: `challengers` and `shares` from
        the single-challenger fields (a v2 payload), or those from the first challenger."""
        if isinstance(data, dict) and "current" in data:
            return complete_allocation(data)
        return data

    @model_validator(mode="after")
    def _consistent(self) -> AllocationChanged:
        names = [c.version for c in self.challengers]
        if len(set(names)) != len(names) or self.current in names:
            raise ValueError("challengers must be distinct and differ from the current version")
        if set(self.shares) != {self.current, *names}:
            raise ValueError("shares must name the current version and every challenger, only")
        if any(v < 0 for v in self.shares.values()):
            raise ValueError("a share cannot be negative")
        if abs(math.fsum(self.shares.values()) - 1.0) > SHARES_TOLERANCE:
            raise ValueError(f"shares must sum to 1, not {math.fsum(self.shares.values())}")
        first = self.challengers[0] if self.challengers else None
        if (first.version if first else None) != self.challenger or (
            first is not None
            and (first.rung, first.ladder, self.shares[first.version])
            != (self.rung, self.ladder, self.challenger_share)
        ):
            raise ValueError("challenger, challenger_share, rung and ladder name the first one")
        return self


def complete_allocation(payload: dict[str, Any]) -> dict[str, Any]:
    """An allocation payload with both forms filled in (see `AllocationChanged`)."""
    out = dict(payload)
    current = out["current"]
    if "challengers" not in out:  # one challenger at most, in the single-challenger fields
        challenger, share = out.get("challenger"), float(out.get("challenger_share", 0.0))
        if challenger:
            rung = out.get("rung") or (Rung.TRIAL if share > 0 else Rung.SHADOW)
            out["rung"] = rung
            out["challengers"] = [
                {"version": challenger, "rung": rung, "ladder": out.get("ladder", Ladder.DEFAULT)}
            ]
            out.setdefault("shares", {current: 1.0 - share, challenger: share})
        else:
            out["challengers"] = []
            out.setdefault("shares", {current: 1.0})
        return out
    live = [LiveChallenger.model_validate(c) for c in out["challengers"]]
    if live and "challenger" not in out:
        first = live[0]
        out.update(
            challenger=first.version,
            challenger_share=dict(out.get("shares", {})).get(first.version, 0.0),
            rung=first.rung,
            ladder=first.ladder,
        )
    return out


class Promoted(Versioned):
    """The challenger crossed the accept boundary and is now current."""

    type: ClassVar[str] = "Promoted"
    version: ClassVar[int] = 1
    tenant: TenantId = Field(description="Tenant.")
    workflow_id: WorkflowId = Field(description="Workflow.")
    workflow_version: WorkflowVersion = Field(description="The new current version.")
    previous: WorkflowVersion = Field(description="The version it replaced.")
    record: WinRecord = Field(description="The record at the decision.")
    llr: float = Field(description="Log-likelihood ratio at the decision.")


class ChallengerRejected(Versioned):
    """The challenger was rejected; the current version stays."""

    type: ClassVar[str] = "ChallengerRejected"
    version: ClassVar[int] = 1
    tenant: TenantId = Field(description="Tenant.")
    workflow_id: WorkflowId = Field(description="Workflow.")
    workflow_version: WorkflowVersion = Field(description="The rejected challenger.")
    reason: str = Field(description="Why.")
    record: WinRecord = Field(description="The record at the decision.")
    llr: float = Field(description="Log-likelihood ratio at the decision.")


class RolledBack(Versioned):
    """The challenger was taken off all traffic, automatically and unconditionally (§12.3):
    a `Core` violation on one of its episodes, or its verifier pass rate fell below the
    current version's by more than the configured margin. A traffic change, never a
    delete: the version stays in the DAG with its results."""

    type: ClassVar[str] = "RolledBack"
    version: ClassVar[int] = 1
    tenant: TenantId = Field(description="Tenant.")
    workflow_id: WorkflowId = Field(description="Workflow.")
    workflow_version: WorkflowVersion = Field(description="The challenger rolled back.")
    current: WorkflowVersion = Field(description="The version that keeps all traffic.")
    rung: Rung = Field(description="The rung it was rolled back from.")
    trigger: Literal["capped", "pass_rate"] = Field(
        description="A Core violation (`capped`) or a pass-rate regression (`pass_rate`)."
    )
    reason: str = Field(description="What was found, for people.")
    record: WinRecord = Field(description="Its selection record at the rollback.")
    runs: int = Field(ge=0, description="Its graded runs on selection tasks.")
    passes: int = Field(ge=0, description="Of which passed verification.")
    baseline_runs: int = Field(ge=0, description="The current version's, on selection tasks.")
    baseline_passes: int = Field(ge=0, description="Of which passed verification.")


def variant_aggregate_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """VariantAggregate v1 -> v2: v1 carried win records only."""
    return {**payload, "strength": None}


def variant_aggregate_v2_to_v3(payload: dict[str, Any]) -> dict[str, Any]:
    """VariantAggregate v2 -> v3: v2 knew no held-out set (every task was a selection
    task) and reported none of the ladder's counts, so it moves no rung."""
    return {
        **payload,
        "screened": 0,
        "served": 0,
        "baseline_runs": 0,
        "baseline_passes": 0,
        "order_checked": 0,
        "order_inconsistent": 0,
        "held_out": None,
    }


def variant_aggregate_v3_to_v4(payload: dict[str, Any]) -> dict[str, Any]:
    """VariantAggregate v3 -> v4: v3 carried no failure evidence."""
    return {**payload, "failures": []}


def allocation_changed_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """AllocationChanged v1 -> v2: v1 knew one ladder; a challenger with no share of live
    tasks was in shadow, one with a share on trial."""
    rung = None
    if payload.get("challenger"):
        rung = Rung.TRIAL.value if payload.get("challenger_share", 0.0) > 0 else Rung.SHADOW.value
    return {**payload, "rung": rung, "ladder": Ladder.DEFAULT.value}


def allocation_changed_v2_to_v3(payload: dict[str, Any]) -> dict[str, Any]:
    """AllocationChanged v2 -> v3: v2 held one challenger at most; its share, the current
    version's the rest."""
    return complete_allocation(payload)
