"""The proposer's spend (§14.1): reserved before a draft, settled after, metered.

The proposer is asked by decide alone, so the ledger rows of purpose `proposer` live
in decide's own schema (or SQLite file): decide's partitions and replicas are the
concurrency the tenant's ceiling must hold against, and they share the row. A
draft's worst case (the proposer's `worst_case`, when it offers one) is reserved
before the proposer is asked; a draft that does not fit is not asked for (a
`ProposerFailed` naming the ceiling, recorded as a proposal not made). What the
draft really cost settles the reservation and is emitted on `assay.usage` as purpose
`proposer`, with no run.
"""

from __future__ import annotations

from assay.bus.topics import USAGE
from assay.grading.proposers import Proposal, ProposalInput, Proposer, ProposerFailed, ProposerUsage
from assay.kernel.spend import Spend
from assay.messages import Purpose, UsageRecorded
from assay_decide.deciding import DecideUnitOfWork

PROPOSER = Purpose.PROPOSER.value
"""The ledger purpose of the proposer's model calls."""


def worst_case(proposer: Proposer, request: ProposalInput) -> Spend:
    """What drafting for `request` may cost: the proposer's own bound, else one call."""
    bound = getattr(proposer, "worst_case", None)
    if not callable(bound):
        return Spend(calls=1)
    usage = bound(request)
    assert isinstance(usage, ProposerUsage)
    return _spend(usage)


def _spend(u: ProposerUsage) -> Spend:
    return Spend.of(u.model_calls, u.prompt_tokens + u.completion_tokens, u.cost_usd)


async def propose_within_ceiling(uow: DecideUnitOfWork, request: ProposalInput) -> Proposal | None:
    """The proposer's draft for `request`, its worst case reserved first.

    Raises:
        ProposerFailed: the tenant's proposer ceiling for the day has no room for the
            draft (nothing was asked), or the proposer failed.
    """
    deps = uow.deps
    day = uow.envelope.occurred_at.date().isoformat()
    limit = deps.proposals.limit_for(str(uow.tenant))
    held = await uow.log.reserve(
        uow.tenant, PROPOSER, day, worst_case(deps.proposer, request), limit
    )
    if held is None:
        raise ProposerFailed(
            f"the tenant's proposer ceiling for {day} ({limit.describe()}) has no room "
            "for another draft"
        )
    usage = ProposerUsage()
    try:
        proposal = await deps.proposer.propose(request)
        usage = proposal.usage if proposal is not None else usage
        return proposal
    except ProposerFailed as exc:
        usage = exc.usage
        raise
    finally:
        await uow.log.settle(held, _spend(usage))
        _meter(uow, usage)


def _meter(uow: DecideUnitOfWork, usage: ProposerUsage) -> None:
    """The draft's model calls on `assay.usage` (one record per draft: its calls summed)."""
    if usage.model_calls == 0:
        return
    proposer = uow.deps.proposer
    uow.emit(
        USAGE,
        UsageRecorded(
            tenant=uow.tenant,
            run_id=None,
            purpose=Purpose.PROPOSER,
            model=str(getattr(proposer, "model_id", proposer.name)),
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cost_usd=usage.cost_usd,
        ),
    )
