"""The slow loop through the decide stage (§12.1): a challenger's end without a replacement
asks the proposer for the next version; proposals wait for an operator unless the tenant
is ungated; the proposer reads selection-set failures only and never repeats a version."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from assay.bus import WORKFLOWS, dlq
from assay.grading.proposers import (
    Proposal,
    ProposalInput,
    ProposalPolicy,
    ProposerFailed,
    ProposerUsage,
)
from assay.kernel import RunId, TaskId, TenantId
from assay.kernel.canonical import content_hash
from assay.kernel.scores import WinRecord
from assay.messages import (
    AllocationChanged,
    ChallengerRejected,
    FailureEvidence,
    ProposalRequested,
    ReviewProposal,
    Rung,
    VerifierResult,
    WorkflowRegistered,
)
from assay.store import OutboxEntry
from assay.workflow import WorkflowDef, from_document
from services.decide.tests.decide_harness import (
    TENANT,
    Stage,
    evidence,
    ir,
    only_allocation,
    open_stage,
)

LOSSES = WinRecord(judge_losses=4, verifier_losses=2)  # crosses the reject boundary


def failure(n: int, version: int = 1) -> FailureEvidence:
    return FailureEvidence(
        run_id=RunId(f"01HZX3V8Q6M9T2K4R7W1Y5N0{n:02d}"),
        task_id=TaskId(content_hash({"question": f"{n} + {n}"})),
        workflow_version=ir(version).version,
        failed_checks=[
            VerifierResult(
                verifier="correct",
                kind="exact",
                verifier_version="1",
                passed=False,
                evidence=f"expected {2 * n}, got {2 * n + 1}",
            )
        ],
    )


FAILURES = [failure(1), failure(2), failure(3, version=2)]


def review(proposal: str, approve: bool, reason: str = "") -> ReviewProposal:
    return ReviewProposal(
        tenant=TENANT, workflow_id="arith", proposal_id=proposal, approve=approve, reason=reason
    )


async def reject_challenger(stage: Stage, failures: list[FailureEvidence]) -> list[Any]:
    out = await stage.evidence(evidence(2, record=LOSSES, failures=failures))
    assert [type(m) for m in out[:2]] == [ChallengerRejected, AllocationChanged]
    return out[2:]


@pytest.fixture
async def stage(tmp_path: Path) -> AsyncIterator[Stage]:
    async with open_stage(tmp_path) as s:
        await s.register(1)
        await s.register(2)
        yield s


async def test_a_rejected_challenger_asks_for_a_proposal_that_waits_for_approval(
    stage: Stage,
) -> None:
    (proposal,) = await reject_challenger(stage, FAILURES)
    assert isinstance(proposal, ProposalRequested)
    assert proposal.gated
    assert (proposal.parent, proposal.after) == (ir(1).version, ir(2).version)
    assert proposal.proposer == "catalog"
    assert proposal.rationale.startswith("reason_step_by_step:")
    assert proposal.evidence == [f.run_id for f in FAILURES]
    drafted = WorkflowDef.model_validate(proposal.definition)
    assert drafted.version == proposal.workflow_version
    assert drafted.steps[0].prompt.endswith("Think step by step.")  # type: ignore[union-attr]
    doc = await stage.state("proposal", proposal.proposal_id)
    assert doc is not None
    assert (doc["status"], len(doc["failures"])) == ("pending", 3)
    assert await stage.state("open_proposal", "arith") == {"proposal_id": proposal.proposal_id}
    # nothing is registered until an operator approves
    assert (await stage.allocation())["challenger"] is None


async def test_approving_registers_the_version_which_then_enters_shadow(stage: Stage) -> None:
    (proposal,) = await reject_challenger(stage, FAILURES)
    await stage.send(WORKFLOWS, review(proposal.proposal_id, approve=True, reason="looks right"))
    (registration,) = await stage.take()
    assert isinstance(registration, WorkflowRegistered)
    assert registration.parents == [ir(1).version]
    assert registration.definition == proposal.definition
    doc = await stage.state("proposal", proposal.proposal_id)
    assert doc is not None
    assert (doc["status"], doc["review"]) == (
        "approved",
        {"reason": "looks right", "by": "operator"},
    )
    assert await stage.state("open_proposal", "arith") is None
    # the registration comes back on assay.workflows: the draft is the challenger, in shadow
    await stage.send(WORKFLOWS, registration)
    alloc = only_allocation(await stage.take())
    assert (alloc.challenger, alloc.rung) == (proposal.workflow_version, Rung.SHADOW)
    # a repeated approval changes nothing
    await stage.send(WORKFLOWS, review(proposal.proposal_id, approve=True))
    assert await stage.take() == []


async def test_rejecting_a_proposal_asks_for_the_next_one_with_the_reason(stage: Stage) -> None:
    (first,) = await reject_challenger(stage, FAILURES)
    await stage.send(WORKFLOWS, review(first.proposal_id, approve=False, reason="too verbose"))
    (second,) = await stage.take()
    assert isinstance(second, ProposalRequested)
    assert second.workflow_version != first.workflow_version
    assert second.rationale.startswith("answer_only:")
    assert second.after == first.workflow_version
    doc = await stage.state("proposal", first.proposal_id)
    assert doc is not None
    assert doc["status"] == "rejected"
    # the catalog has nothing more for wrong answers: the loop says so and waits
    await stage.send(WORKFLOWS, review(second.proposal_id, approve=False))
    assert await stage.take() == []
    unproposed = await stage.state("unproposed", "arith")
    assert unproposed is not None
    assert "nothing left to propose" in unproposed["reason"]


async def test_a_rejection_without_failures_proposes_nothing(stage: Stage) -> None:
    assert await reject_challenger(stage, []) == []
    unproposed = await stage.state("unproposed", "arith")
    assert unproposed is not None
    assert unproposed["reason"] == "no selection-set failure to learn from"
    assert unproposed["after"] == ir(2).version


async def test_a_rollback_asks_for_a_proposal_too(stage: Stage) -> None:
    capped = WinRecord(judge_wins=2, capped=1)
    out = await stage.evidence(evidence(2, record=capped, served=1, failures=FAILURES))
    assert [type(m).__name__ for m in out] == [
        "RolledBack",
        "AllocationChanged",
        "ProposalRequested",
    ]


async def test_approval_waits_while_another_challenger_climbs(stage: Stage) -> None:
    (proposal,) = await reject_challenger(stage, FAILURES)
    only_allocation(await stage.register(3))  # an operator registered a challenger by hand
    await stage.send(WORKFLOWS, review(proposal.proposal_id, approve=True))
    (refused,) = await stage.take()
    assert isinstance(refused, OutboxEntry)
    assert refused.topic == dlq("decide")
    reason = dict(refused.headers)["assay-dlq-reason"].decode()
    assert f"has challenger {ir(3).version}" in reason
    doc = await stage.state("proposal", proposal.proposal_id)
    assert doc is not None
    assert doc["status"] == "pending"


async def test_reviews_of_unknown_or_decided_proposals_are_refused(stage: Stage) -> None:
    (proposal,) = await reject_challenger(stage, FAILURES)
    await stage.send(WORKFLOWS, review("0" * 16, approve=True))
    (unknown,) = await stage.take()
    assert "no proposal 0000000000000000" in dict(unknown.headers)["assay-dlq-reason"].decode()
    await stage.send(WORKFLOWS, review(proposal.proposal_id, approve=True))
    await stage.take()
    await stage.send(WORKFLOWS, review(proposal.proposal_id, approve=False))
    (twice,) = await stage.take()
    assert "already approved" in dict(twice.headers)["assay-dlq-reason"].decode()


async def test_another_tenant_cannot_review_a_proposal(stage: Stage) -> None:
    (proposal,) = await reject_challenger(stage, FAILURES)
    other = TenantId(uuid.UUID("00000000-0000-4000-8000-0000000000e2"))
    foreign = review(proposal.proposal_id, approve=True).model_copy(update={"tenant": other})
    await stage.send(WORKFLOWS, foreign, tenant=other)
    (refused,) = await stage.take()
    assert f"for tenant {other}" in dict(refused.headers)["assay-dlq-reason"].decode()
    doc = await stage.state("proposal", proposal.proposal_id)
    assert doc is not None
    assert doc["status"] == "pending"


async def test_an_ungated_tenant_gets_its_proposal_registered_at_once(tmp_path: Path) -> None:
    policy = ProposalPolicy(ungated=frozenset({str(TENANT)}))
    async with open_stage(tmp_path, proposals=policy) as stage:
        await stage.register(1)
        await stage.register(2)
        proposal, registration = await reject_challenger(stage, FAILURES)
        assert isinstance(proposal, ProposalRequested)
        assert not proposal.gated
        assert isinstance(registration, WorkflowRegistered)
        assert registration.definition == proposal.definition
        doc = await stage.state("proposal", proposal.proposal_id)
        assert doc is not None
        assert (doc["status"], doc["review"]["by"]) == ("approved", "ungated")


class Recording:
    """A proposer that records what it was shown and drafts from a given document."""

    name = "recording"

    def __init__(self, draft: dict[str, Any] | None = None, fail: str | None = None) -> None:
        self.draft, self.fail = draft, fail
        self.seen: list[ProposalInput] = []

    async def propose(self, request: ProposalInput) -> Proposal | None:
        self.seen.append(request)
        if self.fail is not None:
            raise ProposerFailed(self.fail, ProposerUsage(1, 10, 5))
        if self.draft is None:
            return None
        return Proposal(from_document(self.draft), "because", ProposerUsage(1, 100, 50))

    async def aclose(self) -> None:
        pass


async def test_the_proposer_sees_the_evidence_and_every_version_tried(tmp_path: Path) -> None:
    draft = {"id": "arith", "steps": [{"id": "solve", "kind": "model", "prompt": "new"}]}
    proposer = Recording(draft)
    async with open_stage(tmp_path, proposer=proposer) as stage:
        await stage.register(1)
        await stage.register(2)
        (proposal,) = await reject_challenger(stage, FAILURES)
        (request,) = proposer.seen
        assert request.failures == FAILURES
        assert (request.current.version, request.ended) == (ir(1).version, ir(2))
        assert request.outcome == "rejected"
        assert {ir(1).version, ir(2).version} <= request.tried
        assert proposal.proposer == "recording"
        assert (proposal.usage.prompt_tokens, proposal.usage.completion_tokens) == (100, 50)


async def test_a_failing_proposer_is_recorded_and_the_rejection_stands(tmp_path: Path) -> None:
    async with open_stage(tmp_path, proposer=Recording(fail="the model call failed")) as stage:
        await stage.register(1)
        await stage.register(2)
        assert await reject_challenger(stage, FAILURES) == []
        unproposed = await stage.state("unproposed", "arith")
        assert unproposed is not None
        assert unproposed["reason"] == "the model call failed"
        assert unproposed["usage"]["model_calls"] == 1


async def test_an_invalid_draft_is_refused_before_anyone_sees_it(tmp_path: Path) -> None:
    draft = {"id": "arith", "steps": [{"id": "solve", "kind": "tool", "tool": "no_such_tool"}]}
    async with open_stage(tmp_path, proposer=Recording(draft)) as stage:
        await stage.register(1)
        await stage.register(2)
        assert await reject_challenger(stage, FAILURES) == []
        unproposed = await stage.state("unproposed", "arith")
        assert unproposed is not None
        assert unproposed["reason"].startswith("draft refused: invalid workflow")


# -- `assay proposals` on the data directory --------------------------------------------------


async def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    from assay.cli import _dispatch, _parser

    assert await _dispatch(_parser().parse_args(list(argv))) == 0
    return json.loads(capsys.readouterr().out)


async def test_the_cli_lists_shows_and_approves_a_proposal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ASSAY_DATABASE_URL", raising=False)
    monkeypatch.delenv("ASSAY_KAFKA_BOOTSTRAP", raising=False)
    async with open_stage(tmp_path) as stage:
        await stage.register(1)
        await stage.register(2)
        (proposal,) = await reject_challenger(stage, FAILURES)
    (tmp_path / "decide.relay.lock").unlink(missing_ok=True)  # the hand-fed stage's relay's
    data = ("--data-dir", str(tmp_path))
    listed = await cli(capsys, *data, "proposals")
    (row,) = listed["proposals"]
    assert (row["proposal_id"], row["status"]) == (proposal.proposal_id, "pending")
    shown = await cli(capsys, *data, "proposals", "show", proposal.proposal_id)
    assert shown["definition"] == proposal.definition
    assert len(shown["failures"]) == len(FAILURES)
    approved = await cli(
        capsys, *data, "proposals", "approve", proposal.proposal_id, "--reason", "worth a trial"
    )
    assert approved["status"] == "approved"
    assert approved["review"] == {"reason": "worth a trial", "by": "operator"}
    assert (await cli(capsys, *data, "proposals"))["proposals"] == []
    every = await cli(capsys, *data, "proposals", "--all")
    assert [r["status"] for r in every["proposals"]] == ["approved"]
