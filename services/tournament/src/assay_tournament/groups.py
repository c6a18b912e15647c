"""Tournament grading (§11.4-§11.6): groups that fill, close once, and never reopen.

A group is keyed `(tenant, task, outcome class, epoch)`. An episode joins the
open group of its task and verifier outcome class; the group closes when it
reaches its quorum or when its timeout passes (a timer in this stage sends
itself a `GroupDue`, ordered with the task's episodes on their partition), and
is graded once: Swiss pairing, both orderings, Bradley-Terry-Davidson with the
control version pinned to zero. Closing moves the task's outcome class to the
next epoch, so a late arrival starts a new group — strengths already published
never change underneath a decision (§11.6). A group that closes with one
member reports `Ungraded{InsufficientGroup}`, a stated reason, not a silence; a
member the judge answered no comparison about is `Ungraded{JudgeFailed}`.
"""

from __future__ import annotations

import time
from typing import Any

from assay.bus.topics import VERIFIED
from assay.grading.attempts import AttemptGrades
from assay.grading.tournament import Entrant, run_tournament
from assay.kernel import RunId, TaskId, TenantId
from assay.kernel.scores import Ungraded, UngradedReason
from assay.messages import Episode, GroupDue, JudgePurpose, Role, RunVerified
from assay.record import BranchKey
from assay.runtime import UnitOfWork
from assay.runtime.timers import Fired
from assay.workflow import GradingSpec, WorkflowDef
from assay_tournament.events import GroupClosed, GroupJoined, outcome_class
from assay_tournament.grading import Grading, Meter, Waiting, load_episode


def clock_ms() -> int:
    """Wall-clock milliseconds: when a group opened, and whether its timeout passed."""
    return int(time.time() * 1000)


class Groups:
    """The open groups of one stage: joining, closing on quorum or timeout."""

    def __init__(self, grading: Grading) -> None:
        self.grading = grading

    async def join(
        self,
        uow: UnitOfWork[Any],
        msg: RunVerified,
        episode: Episode,
        spec: GradingSpec,
        attempts: AttemptGrades | None,
        meter: Meter,
    ) -> None:
        """Add the episode to its open group; grade the group if that fills it."""
        r = msg.run
        key = f"{r.task_id}/{outcome_class(msg.passed)}"
        doc = await uow.get_document("group", key) or {"epoch": 0, "members": 0}
        fresh = int(doc["members"]) == 0
        opened_ms = clock_ms() if fresh else int(doc["opened_ms"])
        quorum = spec.group_quorum if fresh else int(doc["quorum"])
        timeout_s = spec.timeout_s if fresh else float(doc["timeout_s"])
        members = int(doc["members"]) + 1
        joined = Waiting(msg, attempts, meter.take(r.run_id))
        uow.record(
            BranchKey.main(uow.tenant, f"task:{r.task_id}"),
            GroupJoined(
                task_id=r.task_id,
                passed=msg.passed,
                epoch=int(doc["epoch"]),
                opened_ms=opened_ms,
                quorum=quorum,
                timeout_s=timeout_s,
                members=members,
                member=Grading.waiting_doc(msg, attempts, joined.spent),
            ),
        )
        self.grading.flush(uow, meter)
        if members >= quorum:
            await self.close(
                uow,
                r.task_id,
                msg.passed,
                int(doc["epoch"]),
                extra=joined,
                on_timeout=False,
                meter=meter,
            )
        else:
            self.grading.waiting(
                uow, msg, f"in tournament group {key}#{doc['epoch']} ({members} of {quorum})"
            )

    async def on_due(self, msg: GroupDue, uow: UnitOfWork[Any]) -> None:
        """A group's timeout passed: close it, unless it already closed."""
        key = f"{msg.task_id}/{outcome_class(msg.passed)}"
        doc = await uow.get_document("group", key)
        if doc is None or int(doc["epoch"]) != msg.epoch or int(doc["members"]) == 0:
            return  # closed on quorum meanwhile, or a repeated timer
        await self.close(uow, msg.task_id, msg.passed, msg.epoch, extra=None, on_timeout=True)

    async def close(
        self,
        uow: UnitOfWork[Any],
        task: TaskId,
        passed: bool,
        epoch: int,
        *,
        extra: Waiting | None,
        on_timeout: bool,
        meter: Meter | None = None,
    ) -> None:
        """Grade the group once and move its task and outcome class to the next epoch.

        `meter` is the handler's own when it already changed it (a join that fills the
        group): the committed one would not hold those changes yet.
        """
        key = f"{task}/{outcome_class(passed)}"
        members = [
            Grading.waiting_from(doc) for _, doc in await uow.scan_documents("member", f"{key}/")
        ]
        if extra is not None and all(
            m.verified.run.run_id != extra.verified.run.run_id for m in members
        ):
            members.append(extra)  # joined in this very commit: not in state yet
        members.sort(key=lambda m: str(m.verified.run.run_id))
        if meter is None:
            meter = await self.grading.meter(uow)
        episodes: dict[RunId, Episode] = {}
        for m in members:
            episode = await load_episode(uow, m.verified.episode)
            if episode is None:
                self.grading.finish(
                    uow,
                    m.verified,
                    None,
                    Ungraded(reason=UngradedReason.EPISODE_UNAVAILABLE),
                    attempts=m.attempts,
                    carried=m.spent,
                    meter=meter,
                )
            else:
                episodes[m.verified.run.run_id] = episode
        graded = [m for m in members if m.verified.run.run_id in episodes]
        answered = failed = inconsistent = 0
        anchored = False
        if len(graded) < 2 or meter.exhausted(uow.tenant):
            reason = (
                UngradedReason.INSUFFICIENT_GROUP
                if len(graded) < 2
                else UngradedReason.BUDGET_EXHAUSTED
            )
            for m in graded:
                self.grading.finish(
                    uow,
                    m.verified,
                    episodes[m.verified.run.run_id],
                    Ungraded(reason=reason),
                    attempts=m.attempts,
                    carried=m.spent,
                    meter=meter,
                )
        else:
            first = episodes[graded[0].verified.run.run_id]
            spec = WorkflowDef.model_validate(first.definition)
            sinks = {
                m.verified.run.run_id: meter.sink(m.verified.run.run_id, JudgePurpose.TOURNAMENT)
                for m in graded
            }
            outcome = await run_tournament(
                [
                    Entrant(
                        name=str(m.verified.run.run_id),
                        episode=episodes[m.verified.run.run_id],
                        control=m.verified.run.role is Role.CURRENT,
                    )
                    for m in graded
                ],
                self.grading.deps.judge,
                list(spec.rubric),
                seed=f"{uow.tenant}/{key}/{epoch}",
                prior_precision=spec.grading.precision,
                on_usage=lambda shown, usage: sinks[RunId(shown)](usage),
            )
            for failure in outcome.failures:
                meter.failed(RunId(failure.billed_to), JudgePurpose.TOURNAMENT, failure.reason)
            for bout in outcome.bouts:
                if bout.consistent is not None:
                    meter.order_checked(consistent=bout.consistent)
            answered, failed = outcome.answered, len(outcome.failures)
            inconsistent, anchored = outcome.inconsistent, outcome.anchored
            for m in graded:
                self.grading.finish(
                    uow,
                    m.verified,
                    episodes[m.verified.run.run_id],
                    outcome.scores[str(m.verified.run.run_id)],
                    meter=meter,
                    attempts=m.attempts,
                    carried=m.spent,
                )
        self.grading.flush(uow, meter)
        uow.record(
            BranchKey.main(uow.tenant, f"task:{task}"),
            GroupClosed(
                task_id=task,
                passed=passed,
                epoch=epoch,
                runs=[m.verified.run.run_id for m in members],
                on_timeout=on_timeout,
                judge_calls=answered,
                judge_failures=failed,
                inconsistent=inconsistent,
                anchored=anchored,
            ),
        )

    @staticmethod
    def due(tenant: TenantId, key: str, doc: dict[str, Any], now_ms: float) -> Fired | None:
        """An open group whose timeout passed sends itself its `GroupDue`."""
        if int(doc.get("members", 0)) == 0:
            return None
        epoch = int(doc["epoch"])
        if int(doc["opened_ms"]) + float(doc["timeout_s"]) * 1000 > now_ms:
            return None
        task, outcome = key.rsplit("/", 1)
        msg = GroupDue(tenant=tenant, task_id=TaskId(task), passed=outcome == "pass", epoch=epoch)
        return VERIFIED, msg, f"group-due:{key}:{epoch}"
