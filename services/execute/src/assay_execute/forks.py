"""Forks of a run (§8.5): a new branch from an LSN of an ended branch; nothing deleted.

A rewind (`RewindRun`) forks one branch; a branch command (`BranchRun`) forks
one per child, all in one commit. Either way the new branch holds copies of the
parent's records below the fork point, then `Forked` naming the command that
asked for it — which is how a redelivered command finds the forks it made
before a crash instead of making them again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from assay.bus.topics import RUN_STATUS
from assay.engine import RunFinished
from assay.engine.events import Forked, Intent, RunCancelled, RunStarted
from assay.kernel import BranchId, IntentState, Refused, RunId, RunState
from assay.messages import RewindRun, RunBranch, RunStatusChanged
from assay.record import BranchKey, LogRecord
from assay_execute.driving import ExecuteUnitOfWork


@dataclass(frozen=True)
class Fork:
    """A branch a command forked: its id, the `Forked` record it carries, whether it ended."""

    branch: BranchId
    forked: Forked
    ended: bool


async def forks_of(uow: ExecuteUnitOfWork, run: RunId) -> list[Fork]:
    """Every branch of the run that the message being handled forked, by branch."""
    found = []
    for k in await uow.log.branches(run, uow.tenant):
        records = await uow.log.read(k)
        # Its own Forked is its last: a fork of a fork begins with a copy of its parent's.
        forked = next((r.event for r in reversed(records) if isinstance(r.event, Forked)), None)
        if forked is not None and forked.command == str(uow.envelope.id):
            found.append(Fork(k.branch, forked, ended(records)))
    return sorted(found, key=lambda f: f.branch)


def ended(records: Sequence[LogRecord]) -> bool:
    """Whether a branch's records reach its end."""
    return any(isinstance(r.event, RunFinished | RunCancelled) for r in records)


async def run_ended(uow: ExecuteUnitOfWork, run: RunId) -> bool:
    """Whether the run's live branch has reached its end."""
    keys = await uow.log.branches(run, uow.tenant)
    if not keys:
        return False
    return ended(await uow.log.read(max(keys, key=lambda k: k.branch)))


async def refuse_if_driven(uow: ExecuteUnitOfWork, run: RunId, what: str) -> None:
    """§8.5: a fork departs from a run that ended. Checked before the lease is claimed:
    a claim by the worker driving the run would take it over from itself.

    Raises:
        Refused: the run is being driven, or waits at an await step.
    """
    if await uow.log.branches(run, uow.tenant) and not await run_ended(uow, run):
        raise Refused(
            f"run {run} is being driven or waits at an await step; cancel it before {what} it"
        )


async def source_branch(
    uow: ExecuteUnitOfWork, run: RunId, branch: int | None, *, rewinds_children: bool = True
) -> tuple[BranchId, BranchId, list[LogRecord]]:
    """(the branch to fork — `branch`, or the live one; the live one; its records).

    With `rewinds_children` False, the default is the run's main line instead of the
    live branch (`main_line`).

    Raises:
        Refused: no such run or branch, or a run recorded before runs kept their
            definition.
    """
    keys = await uow.log.branches(run, uow.tenant)
    if not keys:
        raise Refused(f"no run {run} of this tenant")
    live = max(k.branch for k in keys)
    source = live if branch is None else branch
    if branch is None and not rewinds_children:
        source = await main_line(uow, run, live)
    if source not in {k.branch for k in keys}:
        raise Refused(f"run {run} has no branch {source}")
    records = await uow.log.read(BranchKey.for_run(uow.tenant, run, BranchId(source)))
    first = records[0].event if records else None
    if not isinstance(first, RunStarted) or first.definition is None or first.input is None:
        raise Refused(f"run {run} was recorded before runs kept their definition")
    return BranchId(source), BranchId(live), records


async def main_line(uow: ExecuteUnitOfWork, run: RunId, live: int) -> int:
    """The newest branch on the run's own line: branch 0, or a rewind of a branch on it
    (never a branch command's child, nor a fork of one). A branch command departs
    from it by default, so a second command does not fork the first one's last child."""
    on_line = {0}
    for b in range(1, live + 1):
        records = await uow.log.read(BranchKey.for_run(uow.tenant, run, BranchId(b)))
        forked = next((r.event for r in reversed(records) if isinstance(r.event, Forked)), None)
        if forked is not None and forked.child is None and forked.from_branch in on_line:
            on_line.add(b)
    return max(on_line)


def record_fork(
    uow: ExecuteUnitOfWork,
    run: RunId,
    branch: BranchId,
    records: Sequence[LogRecord],
    forked: Forked,
) -> None:
    """Record (not commit) a new branch: the parent's records below `forked.at`, then
    `forked`, whose `discarded_effects` this fills in; and emit the branch's `Running`
    (unless it is a fork of a rollout group's sibling, which is not graded)."""
    lost = [
        r.event.request_id
        for r in records
        if r.lsn >= forked.at
        and isinstance(r.event, Intent)
        and r.event.state is IntentState.COMMITTED
        and r.event.effect != "idempotent"
    ]
    new = BranchKey.for_run(uow.tenant, run, branch)
    for r in records:
        if r.lsn < forked.at:
            uow.record(new, r.event)
    uow.record(new, forked.model_copy(update={"discarded_effects": lost}))
    started = records[0].event
    if isinstance(started, RunStarted) and (branch == 0 or started.run.rollout is None):
        # The fork's own lifecycle (§5.2) begins: it is verified and graded like any run.
        fork = RunBranch(branch=branch, parent=forked.from_branch, child=forked.child)
        ref = started.run.model_copy(update={"branch": fork})
        detail = f"forked from branch {forked.from_branch} at LSN {forked.at}"
        uow.emit(RUN_STATUS, RunStatusChanged(run=ref, state=RunState.RUNNING, detail=detail))


async def new_rewind(uow: ExecuteUnitOfWork, msg: RewindRun) -> BranchId:
    """Fork the run in one commit for a rewind: the parent's records below `at`, then
    `Forked`.

    Raises:
        Refused: no such run, branch or LSN; a run recorded before runs kept their
            definition; LSN 0 (a branch starts with the run's start); or an LSN past the
            branch's end.
    """
    source, live, records = await source_branch(uow, msg.run_id, msg.branch)
    if msg.at < 1:  # every branch starts with the run's RunStarted, which its readers need
        raise Refused(f"run {msg.run_id}: a fork keeps the run's start: rewind at LSN 1 or later")
    prefix = [r for r in records if r.lsn < msg.at]
    if len(prefix) < msg.at or ended(prefix):
        raise Refused(
            f"run {msg.run_id}: LSN {msg.at} is past the end of branch {source} "
            "(a rewind departs at or before the run's last step)"
        )
    branch = BranchId(live + 1)
    forked = Forked(from_branch=source, at=msg.at, reason=msg.reason, command=str(uow.envelope.id))
    async with uow.step():
        record_fork(uow, msg.run_id, branch, records, forked)
    return branch
