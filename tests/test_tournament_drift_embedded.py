"""The ladder's drift check on a tournament-graded challenger, embedded, end to end.

Every bout of a tournament group is judged in both orders; each entrant's `RunGraded`
(v9) carries the order checks of the bouts it was in, aggregate tallies them beside the
pairwise ones, and decide holds a promotion while the judge contradicted itself on more
than `ASSAY_LADDER_MAX_ORDER_INCONSISTENCY` of them. Both judges here prefer the
challenger; one mirrors itself when the positions swap, the other does not (a draw when
the challenger is shown second). The first challenger is promoted, never held; the
second is held with the ladder's reason. Every record re-folds identically.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from assay.bus import AGGREGATES, DECISIONS, GRADED, RESULTS, TASKS, WORKFLOWS
from assay.cli.rebuild import rebuild
from assay.grading import StubJudge
from assay.grading.judges import JudgeUsage, UsageCallback
from assay.grading.ladder import LadderPolicy
from assay.kernel import tenant_id
from assay.kernel.scores import Ranked, Verdict
from assay.messages import (
    MESSAGES,
    Episode,
    Promoted,
    Role,
    RunGraded,
    RunResult,
    TaskSubmitted,
    VariantAggregate,
    WorkflowRegistered,
    open_envelope,
)
from assay.record import StateKey
from assay.runtime import Embedded
from assay.workflow import RubricItem, WorkflowDef, from_document

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TENANT = tenant_id("0f3c9a57-1d2e-4b6a-8c7d-5e4f3a2b1c0d")
MOST_TASKS = 80
LADDER = LadderPolicy(
    trial_share=0.5,  # half the live tasks on canary: its served episodes come quickly
    ramp_shares=(),  # canary straight to current
    min_trial_runs=2,
    min_strength_episodes=2,
    held_out_fraction=0.0,  # every task is selection evidence
)
"""A resourced ladder sized for a few dozen tasks; the sequential test is the default one,
which accepts only after more wins than the drift check's minimum of order checks."""


def workflow(note: str) -> WorkflowDef:
    """A tournament-graded workflow whose one step reads the task's number (no model)."""
    return from_document(
        {
            "id": "ranked-drift",
            "grading": {"strategy": "tournament", "quorum": 2, "group_timeout_s": 5},
            "steps": [
                {
                    "id": "answer",
                    "kind": "tool",
                    "tool": "extract_number",
                    "args": {"text": note + " {{ task.number }}"},
                }
            ],
            "verifiers": [
                {
                    "id": "correct",
                    "kind": "exact",
                    "step": "answer",
                    "expected": "{{ task.answer }}",
                }
            ],
            "rubric": [{"id": "better", "layer": "contextual", "text": "Prefer the better one."}],
        }
    )


V1 = workflow("the number is")
V2 = workflow("the number, once more, is")


class FavoursChallenger(StubJudge):
    """Prefers the challenger's episode. `mirrors`: it does so in either position; else,
    shown the challenger second, it calls a draw (an order check it fails)."""

    name = "favours-challenger-1"

    def __init__(self, *, mirrors: bool) -> None:
        self.mirrors = mirrors

    async def compare(
        self,
        a: Episode,
        b: Episode,
        rubric: list[RubricItem],
        *,
        on_usage: UsageCallback | None = None,
    ) -> Verdict:
        if on_usage is not None:
            on_usage(JudgeUsage(self.name, 0, 0, 0.0))
        if a.run.workflow_version == V2.version:
            return Verdict.A
        if b.run.workflow_version == V2.version:
            return Verdict.B if self.mirrors else Verdict.DRAW
        return Verdict.DRAW


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def on_bus(rt: Embedded, topic: str) -> list[Any]:
    found = []
    for partition in range(rt.partitions):
        for m in await rt.bus.fetch(topic, partition, 0, 10_000, 0.0):
            env = open_envelope(m.value)
            found.append(MESSAGES.decode(env.type, env.schema_version, env.payload))
    return found


async def register(rt: Embedded, wf: WorkflowDef) -> None:
    definition = wf.model_dump(mode="json", by_alias=True)
    registered = WorkflowRegistered(tenant=TENANT, definition=definition)
    await rt.publish(WORKFLOWS, registered, TENANT, idem=wf.version)


@pytest.mark.parametrize("mirrors", [True, False], ids=["consistent", "inconsistent"])
async def test_a_tournament_challengers_promotion_waits_on_the_judges_order_checks(
    tmp_path: Path, mirrors: bool
) -> None:
    data = tmp_path / "data"
    judge = FavoursChallenger(mirrors=mirrors)
    async with Embedded(data, partitions=4, judge=judge, shadow_rate=1.0, ladder=LADDER) as rt:
        rt.start()
        decide = rt.logs["decide"]
        for wf in (V1, V2):
            await register(rt, wf)

            async def routed(wf: WorkflowDef = wf) -> bool:
                """Decide knows the version and ingest routes by its latest allocation."""
                if await decide.get(StateKey(TENANT, "known", wf.version)) is None:
                    return False
                held = await decide.get(StateKey(TENANT, "allocation", V1.id))
                routing = await rt.logs["ingest"].get(StateKey(TENANT, "allocation", V1.id))
                if held is None or routing is None:
                    return False
                return bool(routing["generation"] >= held["generation"])

            await until(routed, f"{wf.version[:12]} to be routed")

        async def standing() -> dict[str, Any] | None:
            return await decide.get(StateKey(TENANT, "ladder", f"{V1.id}/{V2.version}"))

        async def promoted() -> list[Promoted]:
            return [m for m in await on_bus(rt, DECISIONS) if isinstance(m, Promoted)]

        held: list[str] = []
        for n in range(MOST_TASKS):  # one task at a time: routing follows the ladder
            key = f"task-{n}"
            task = TaskSubmitted(
                tenant=TENANT,
                workflow_id=V1.id,
                idempotency_key=key,
                input={"number": str(n), "answer": str(n)},
            )
            await rt.publish(TASKS, task, TENANT, idem=key)

            async def served(key: str = key) -> bool:
                results = await on_bus(rt, RESULTS)
                return any(isinstance(r, RunResult) and r.idempotency_key == key for r in results)

            await until(served, f"the result of {key}")
            doc = await standing()
            if doc is not None and doc.get("held") is not None:
                held.append(doc["held"])
            if held or await promoted():
                break

        graded = [
            g
            for g in await on_bus(rt, GRADED)
            if isinstance(g, RunGraded) and g.run.role is Role.CHALLENGER
        ]
        evidence = [
            a
            for a in await on_bus(rt, AGGREGATES)
            if isinstance(a, VariantAggregate) and a.workflow_version == V2.version
        ]
        alloc = await decide.get(StateKey(TENANT, "allocation", V1.id))
        promotions = await promoted()

    assert graded, "the challenger was never graded"
    # Each challenger episode was in one bout (a group of two): one order check each.
    bouts = [g for g in graded if isinstance(g.score, Ranked)]
    assert bouts
    assert all(g.order_checked == 1 for g in bouts)
    assert all(g.order_inconsistent == (0 if mirrors else 1) for g in bouts)
    last = max(evidence, key=lambda a: a.runs)
    assert last.order_checked >= 5  # the drift check's minimum: it applies
    assert alloc is not None
    if mirrors:
        assert held == []
        assert last.order_inconsistent == 0
        assert alloc["current"] == V2.version
        assert [p.workflow_version for p in promotions] == [V2.version]
    else:
        assert held, "the promotion was never held"
        assert "the judge contradicted itself on" in held[0]
        assert "order checks, above 30%" in held[0]
        assert last.order_inconsistent == last.order_checked
        assert alloc["current"] == V1.version
        assert promotions == []
    with contextlib.redirect_stdout(io.StringIO()):  # what every stage recorded re-folds
        assert await rebuild(data, check=True) == 0
