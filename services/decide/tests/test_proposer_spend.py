"""The proposer's spend (§14.1): every draft's model calls reach `assay.usage` as purpose
`proposer` with their dollars, and a draft whose worst case does not fit under the
tenant's proposer ceiling for the day is never asked for."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from assay.engine import Prices
from assay.engine.models import Completion
from assay.grading.chat_judge import TEMPLATE_TOKENS
from assay.grading.chat_proposer import SYSTEM, ChatProposer, render
from assay.grading.proposers import (
    Proposal,
    ProposalInput,
    ProposalPolicy,
    ProposerFailed,
    ProposerUsage,
)
from assay.kernel.spend import Spend, SpendLimit
from assay.messages import ProposalRequested, Purpose
from assay.workflow import from_document
from assay_decide.proposer_spend import PROPOSER
from services.decide.tests.decide_harness import TENANT, ir, open_stage
from services.decide.tests.test_decide_proposals import FAILURES, reject_challenger

DRAFT = {"id": "arith", "steps": [{"id": "solve", "kind": "model", "prompt": "new"}]}
SPENT = ProposerUsage(1, 1000, 200, 0.042)


class Priced:
    """A proposer that drafts `DRAFT` for $0.042 and says it could cost at most $0.05."""

    name = "priced"
    model_id = "drafter-8b"

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.asked = 0

    def worst_case(self, request: ProposalInput) -> ProposerUsage:
        return ProposerUsage(1, 2000, 400, 0.05)

    async def propose(self, request: ProposalInput) -> Proposal | None:
        self.asked += 1
        if self.fail:
            raise ProposerFailed("the answer was not a definition", SPENT)
        return Proposal(from_document(DRAFT), "because", SPENT)

    async def aclose(self) -> None:
        pass


def today() -> str:
    return datetime.now(UTC).date().isoformat()


async def test_a_draft_is_metered_as_proposer_spend_with_its_dollars(tmp_path: Path) -> None:
    async with open_stage(tmp_path, proposer=Priced()) as stage:
        await stage.register(1)
        await stage.register(2)
        (proposal,) = await reject_challenger(stage, FAILURES)
        ledger = await stage.log.spend_of(TENANT, PROPOSER, today())
    assert isinstance(proposal, ProposalRequested)
    (usage,) = stage.usage
    assert (usage.tenant, usage.run_id, usage.purpose) == (TENANT, None, Purpose.PROPOSER)
    assert (usage.model, usage.prompt_tokens, usage.completion_tokens) == ("drafter-8b", 1000, 200)
    assert usage.cost_usd == 0.042
    assert ledger.spent == Spend.of(1, 1200, 0.042)
    assert ledger.held == Spend()


async def test_a_failed_draft_is_spend_too(tmp_path: Path) -> None:
    async with open_stage(tmp_path, proposer=Priced(fail=True)) as stage:
        await stage.register(1)
        await stage.register(2)
        assert await reject_challenger(stage, FAILURES) == []
        ledger = await stage.log.spend_of(TENANT, PROPOSER, today())
    (usage,) = stage.usage
    assert usage.cost_usd == 0.042
    assert ledger.spent == Spend.of(1, 1200, 0.042)


async def test_a_draft_over_the_ceiling_is_not_asked_for_and_says_why(tmp_path: Path) -> None:
    proposer = Priced()
    policy = ProposalPolicy(usd_per_day=0.04)  # the worst case, $0.05, does not fit
    async with open_stage(tmp_path, proposer=proposer, proposals=policy) as stage:
        await stage.register(1)
        await stage.register(2)
        assert await reject_challenger(stage, FAILURES) == []
        unproposed = await stage.state("unproposed", "arith")
        ledger = await stage.log.spend_of(TENANT, PROPOSER, today())
    assert proposer.asked == 0
    assert stage.usage == []
    assert unproposed is not None
    assert "proposer ceiling" in unproposed["reason"]
    assert "$0.040000" in unproposed["reason"]
    assert ledger.committed == Spend()


def test_the_policy_reads_calls_tokens_and_dollars_per_tenant() -> None:
    policy = ProposalPolicy.model_validate(
        {"calls_per_day": 3, "usd_per_day": 1.0, "ceilings": f"{TENANT}=1"}
    )
    assert policy.limit_for(str(TENANT)) == SpendLimit(1, None, 1_000_000)
    assert ProposalPolicy().limit_for(str(TENANT)) == SpendLimit()


class _Model:
    name = "m"
    prices = Prices(prompt_per_mtok=2.0, completion_per_mtok=10.0)

    async def complete(self, prompt: str, **kw: Any) -> Completion:
        raise AssertionError("not called")

    async def aclose(self) -> None:
        pass


def test_a_chat_proposers_worst_case_is_its_prompt_bytes_and_answer_at_its_prices() -> None:
    proposer = ChatProposer(_Model(), max_answer_tokens=1000)
    request = ProposalInput(
        tenant=TENANT,
        workflow_id=ir(1).id,
        current=ir(1),
        ended=None,
        outcome="rejected",
        reason="lost",
        failures=FAILURES,
        tried=frozenset(),
    )
    prompt = len(SYSTEM.encode()) + len(render(request, 8).encode()) + TEMPLATE_TOKENS
    worst = proposer.worst_case(request)
    assert worst == ProposerUsage(1, prompt, 1000, (prompt * 2.0 + 1000 * 10.0) / 1_000_000)
