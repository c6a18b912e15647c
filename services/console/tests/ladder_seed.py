"""Workflows for the console's ladder tests: the loop's messages as ingest, aggregate and
decide would publish them, for two tenants — a pairwise ladder (v2 climbs and is
promoted, v3 is rolled back, a proposal is rejected), a live tournament challenger
under a hostile workflow name, and another tenant's workflow."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from itertools import count
from pathlib import Path
from typing import Any

from assay.bus.topics import AGGREGATES, DECISIONS, WORKFLOWS
from assay.grading.sprt import SprtPolicy, llr
from assay.kernel.ids import TenantId, WorkflowId, WorkflowVersion
from assay.kernel.schema import Versioned
from assay.kernel.scores import WinRecord
from assay.messages import (
    AllocationChanged,
    HeldOutTally,
    Ladder,
    Promoted,
    ProposalRequested,
    ReviewProposal,
    RolledBack,
    Rung,
    StrengthSummary,
    Usage,
    VariantAggregate,
    WorkflowRegistered,
)
from assay.runtime.embedded import Embedded
from assay.workflow import from_document
from services.console.tests.console_seed import HOSTILE, TENANT_A, TENANT_B, until_folded

TOURNEY = f"{HOSTILE}/tourney"
"""A workflow id a browser must show as text (and a URL must carry: it has a slash)."""
ROLLBACK_REASON = "a Core violation: the episode leaks a debug trace"
REJECT_REASON = f"no: {HOSTILE}"
PROPOSAL = "0123456789abcdef"
STEPS: list[tuple[str, str]] = [
    ("judge", "win"),
    ("verifier", "win"),
    ("judge", "draw"),
    ("judge", "win"),
    ("judge", "loss"),
    ("judge", "win"),
    ("verifier", "win"),
    ("judge", "win"),
    ("judge", "win"),
    ("judge", "win"),
    ("judge", "win"),
    ("judge", "win"),
]
"""v2's comparisons in order: who decided each, and its outcome from v2's side."""
STRENGTH = StrengthSummary(episodes=6, mean=0.42, interval=(0.1, 0.74), unanchored=0)
HELD_OUT_STRENGTH = StrengthSummary(episodes=3, mean=0.2, interval=(-0.3, 0.7), unanchored=1)


def definition(workflow: str, note: str, strategy: str = "pairwise_sequential") -> dict[str, Any]:
    """A small valid workflow; `note` makes each version distinct."""
    return {
        "id": workflow,
        "description": note,
        "steps": [{"id": "solve", "kind": "model", "prompt": "What is {{ task.question }}?"}],
        "grading": {"strategy": strategy},
    }


def version_of(doc: dict[str, Any]) -> WorkflowVersion:
    return from_document(doc).version


def records() -> list[WinRecord]:
    """v2's record after each of `STEPS`."""
    out, r = [], WinRecord()
    for who, outcome in STEPS:
        field = {"win": "wins", "loss": "losses", "draw": "draws"}[outcome]
        name = "draws" if field == "draws" else f"{who}_{field}"
        r = r.model_copy(update={name: getattr(r, name) + 1})
        out.append(r)
    return out


def expected_path(policy: SprtPolicy) -> list[tuple[int, float]]:
    """(comparisons, llr) of v2's path, from the origin."""
    return [(0, 0.0)] + [(r.comparisons, llr(r.wins, r.losses, policy)) for r in records()]


DEFS = {
    "v1": definition("arith", "the plain prompt"),
    "v2": definition("arith", "step by step"),
    "v3": definition("arith", "leaks a debug trace"),
    "p1": definition("arith", "proposed: shorter"),
    "t1": definition(TOURNEY, "tournament control", "tournament"),
    "t2": definition(TOURNEY, "tournament challenger", "tournament"),
    "s1": definition("secret", "another tenant's"),
}
V = {name: version_of(doc) for name, doc in DEFS.items()}


def _alloc(
    tenant: TenantId,
    workflow: str,
    generation: int,
    current: str,
    challenger: str | None = None,
    rung: Rung | None = None,
    share: float = 0.0,
    ladder: Ladder = Ladder.DEFAULT,
) -> AllocationChanged:
    names = [current] + ([challenger] if challenger else [])
    return AllocationChanged(
        tenant=tenant,
        workflow_id=WorkflowId(workflow),
        generation=generation,
        current=V[current],
        challenger=V[challenger] if challenger else None,
        challenger_share=share,
        shadow_rate=0.25 if challenger else 0.0,
        definitions={V[n]: DEFS[n] for n in names},
        rung=rung,
        ladder=ladder,
    )


def _aggregate(tenant: TenantId, workflow: str, version: str, base: str, **kw: Any) -> Any:
    return VariantAggregate(
        tenant=tenant,
        workflow_id=WorkflowId(workflow),
        workflow_version=V[version],
        baseline_version=V[base],
        **kw,
    )


def ladder_messages() -> list[tuple[str, Versioned, TenantId]]:
    """Every message, in the order the loop would publish them."""
    a, b = TENANT_A, TENANT_B
    arith = WorkflowId("arith")
    out: list[tuple[str, Versioned, TenantId]] = [
        (WORKFLOWS, WorkflowRegistered(tenant=a, definition=DEFS["v1"]), a),
        (DECISIONS, _alloc(a, "arith", 1, "v1"), a),
        (WORKFLOWS, WorkflowRegistered(tenant=a, definition=DEFS["v2"]), a),
        (DECISIONS, _alloc(a, "arith", 2, "v1", "v2", Rung.SHADOW), a),
    ]
    for i, r in enumerate(records()):
        if i == 3:
            out.append((DECISIONS, _alloc(a, "arith", 3, "v1", "v2", Rung.TRIAL, 0.05), a))
        out.append(
            (
                AGGREGATES,
                _aggregate(
                    a,
                    "arith",
                    "v2",
                    "v1",
                    record=r,
                    runs=i + 1,
                    passes=i,
                    baseline_runs=10,
                    baseline_passes=6,
                    held_out=HeldOutTally(
                        runs=4,
                        passes=2,
                        record=WinRecord(judge_wins=1),
                        baseline_runs=4,
                        baseline_passes=2,
                    ),
                ),
                a,
            )
        )
    final = records()[-1]
    out += [
        (
            DECISIONS,
            Promoted(
                tenant=a,
                workflow_id=arith,
                workflow_version=V["v2"],
                previous=V["v1"],
                record=final,
                llr=llr(final.wins, final.losses, SprtPolicy()),
            ),
            a,
        ),
        (DECISIONS, _alloc(a, "arith", 4, "v2"), a),
        # A run still in flight at the promotion: evidence that moves nothing any more.
        (
            AGGREGATES,
            _aggregate(
                a,
                "arith",
                "v2",
                "v1",
                record=final.model_copy(update={"judge_losses": final.judge_losses + 1}),
                runs=13,
                passes=12,
            ),
            a,
        ),
        (WORKFLOWS, WorkflowRegistered(tenant=a, definition=DEFS["v3"]), a),
        (DECISIONS, _alloc(a, "arith", 5, "v2", "v3", Rung.SHADOW), a),
        (
            AGGREGATES,
            _aggregate(a, "arith", "v3", "v2", record=WinRecord(capped=1), runs=1, passes=1),
            a,
        ),
        (
            DECISIONS,
            RolledBack(
                tenant=a,
                workflow_id=arith,
                workflow_version=V["v3"],
                current=V["v2"],
                rung=Rung.SHADOW,
                trigger="capped",
                reason=ROLLBACK_REASON,
                record=WinRecord(capped=1),
                runs=1,
                passes=1,
                baseline_runs=10,
                baseline_passes=8,
            ),
            a,
        ),
        (DECISIONS, _alloc(a, "arith", 6, "v2"), a),
        (
            AGGREGATES,
            _aggregate(a, "arith", "v3", "v2", record=WinRecord(capped=2), runs=2, passes=2),
            a,
        ),
        (
            DECISIONS,
            ProposalRequested(
                tenant=a,
                workflow_id=arith,
                proposal_id=PROPOSAL,
                workflow_version=V["p1"],
                parent=V["v2"],
                after=V["v3"],
                definition=DEFS["p1"],
                rationale="shorter answers",
                proposer="catalog",
                evidence=[],
                usage=Usage(),
                gated=True,
            ),
            a,
        ),
        (
            WORKFLOWS,
            ReviewProposal(
                tenant=a,
                workflow_id=arith,
                proposal_id=PROPOSAL,
                approve=False,
                reason=REJECT_REASON,
            ),
            a,
        ),
        (WORKFLOWS, WorkflowRegistered(tenant=a, definition=DEFS["t1"]), a),
        (DECISIONS, _alloc(a, TOURNEY, 1, "t1", ladder=Ladder.RESOURCED), a),
        (WORKFLOWS, WorkflowRegistered(tenant=a, definition=DEFS["t2"]), a),
        (DECISIONS, _alloc(a, TOURNEY, 2, "t1", "t2", Rung.SHADOW, ladder=Ladder.RESOURCED), a),
        (
            AGGREGATES,
            _aggregate(
                a,
                TOURNEY,
                "t2",
                "t1",
                record=WinRecord(judge_wins=4, judge_losses=1, draws=1),
                runs=6,
                passes=6,
                strength=STRENGTH,
                held_out=HeldOutTally(
                    runs=3,
                    passes=2,
                    record=WinRecord(),
                    strength=HELD_OUT_STRENGTH,
                    baseline_runs=3,
                    baseline_passes=2,
                ),
            ),
            a,
        ),
        (WORKFLOWS, WorkflowRegistered(tenant=b, definition=DEFS["s1"]), b),
        (DECISIONS, _alloc(b, "secret", 1, "s1"), b),
    ]
    return out


T0 = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


async def seed_ladder(data_dir: Path) -> None:
    """Publish the ladder's messages a minute apart and wait until the console folded them."""
    ticks = count()
    async with Embedded(
        data_dir,
        stages=("console",),
        partitions=4,
        clock=lambda: T0 + timedelta(minutes=next(ticks)),
    ) as rt:
        items = ladder_messages()
        for n, (topic, msg, tenant) in enumerate(items):  # one at a time: one clock tick each
            await rt.publish_many([(topic, msg, tenant, f"ladder:{n}")])
        rt.start()
        await until_folded(rt)


OPEN_PROPOSAL = "00000000000000b1"
"""Tenant B's proposal that waits for an operator (the browser rejects it)."""


async def seed_open_proposal(data_dir: Path) -> None:
    """Propose a gated version of tenant B's workflow, with a hostile rationale."""
    b = TENANT_B
    message = ProposalRequested(
        tenant=b,
        workflow_id=WorkflowId("secret"),
        proposal_id=OPEN_PROPOSAL,
        workflow_version=WorkflowVersion("b1" * 32),
        parent=WorkflowVersion("b0" * 32),
        after=WorkflowVersion("b2" * 32),
        definition={"id": "secret"},
        rationale=HOSTILE,
        proposer="catalog",
        evidence=[],
        usage=Usage(),
        gated=True,
    )
    async with Embedded(data_dir, stages=("console",), partitions=4) as rt:
        await rt.publish_many([(DECISIONS, message, b, "open-proposal")])
        rt.start()
        await until_folded(rt)
