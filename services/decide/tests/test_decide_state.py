"""Every document decide keeps reads back as its read model, unchanged.

The stored fixture (tests/test_stored_models_grading.py) holds no challenger on the
ladder and no proposal; this scenario writes them."""

from __future__ import annotations

from pathlib import Path

from assay.bus import WORKFLOWS
from assay.kernel.scores import WinRecord
from assay.messages import ProposalRequested, ReviewProposal
from assay.store import EventLog
from assay_decide.state import DECIDE_STATE
from services.decide.tests.decide_harness import TENANT, evidence, open_stage
from services.decide.tests.test_decide_proposals import FAILURES


async def read_back(log: EventLog) -> set[str]:
    """The kinds of document the log holds, each checked to read back unchanged."""
    kinds: set[str] = set()
    for model in DECIDE_STATE:
        for _, key, doc in await log.scan_kind(model.kind):
            assert model.model_validate(doc).model_dump(mode="json") == doc, (model.kind, key)
            kinds.add(model.kind)
    return kinds


async def test_every_kind_of_document_reads_back_unchanged(tmp_path: Path) -> None:
    async with open_stage(tmp_path) as stage:
        await stage.register(1)
        await stage.register(2)  # a challenger on the ladder, in shadow
        kinds = await read_back(stage.log)
        losses = WinRecord(judge_losses=4, verifier_losses=2)
        out = await stage.evidence(evidence(2, record=losses, failures=FAILURES))
        (first,) = [m for m in out if isinstance(m, ProposalRequested)]
        review = ReviewProposal(
            tenant=TENANT, workflow_id="arith", proposal_id=first.proposal_id, approve=False
        )
        await stage.send(WORKFLOWS, review)  # rejected, reviewed; the next one waits
        kinds |= await read_back(stage.log)
    assert {
        "head",
        "allocation",
        "ladder",
        "known",
        "decision",
        "proposal",
        "open_proposal",
    } <= kinds
