"""Retention in the execute stage (§8.6, §10.3): reduce at the token ceiling, then tier.

Execute reads `assay.results`. A `RunResult` means grading of that run has ended
(graded, ungraded, or a cancelled run): `GradingEnded` is recorded on the run's
live branch, and nothing before it makes a run eligible for anything here.

**Reduction.** If the run's episode is over its tenant's token ceiling (the
measure is `assay.engine.retention.episode_tokens`), its summary is written as a
new blob, `Reduced{original, summary}` is committed to the run's branch, and only
then is the original blob deleted. A crash before that commit leaves at most a
summary blob no record names — harmless: content-addressed, and written again to
the same ref if the message comes back. A crash after it, before the delete,
leaves the message unacknowledged (its inbox entry rides on the handler's last
commit), so its redelivery finds the run reduced and deletes the original then;
tiering deletes it again before it moves a run, in case the message never came
back. Deleting a blob that is gone is a no-op.

**Tiering.** Every run is tiered once `tier_after_s` has passed since its reduction
or, under the ceiling, since its grading ended (`TieringQueued`, recorded with
`GradingEnded`), so a run's records are bounded whatever its size; a run never
reduced keeps its episode blob as it is. A sweep of the tenant's queue of untiered
runs follows every result the stage handles (at most once per `sweep_interval_s` per
tenant, at most `sweep_limit` runs). Tiering writes every record of the run — each
branch of the run's stream and of its commands stream — to an archive blob
(`encode_archive`), reads it back, and then, in one commit, deletes those rows from
the log and appends `Tiered{archive, records, streams, documents}` to the run's
tombstone stream (`<run>/tiered`), which stays. `documents` restates what the moved
records had folded to, so re-folding the log without them is still byte-identical.
A graded or ungraded run thereby reaches `Archived` (§5.2): its `RunStatusChanged`
rides in the same commit (a cancelled run stays `Cancelled`), and the archive
still reads back (`decode_archive`; `assay runs show` says where it is).
If a record was appended to one of the streams meanwhile, the commit is refused
(`StreamChanged`) and the run waits for the next sweep; the archive written for
nothing is an orphan blob, like the summary above.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from functools import partial
from typing import Any

from pydantic import ValidationError

from assay.bus.topics import RUN_STATUS, VERIFIED
from assay.engine.events import (
    ArchivedBranch,
    GradingEnded,
    Reduced,
    RunStarted,
    SnapshotDocument,
    Tiered,
    TieringQueued,
    commands_stream,
    fold_work,
)
from assay.engine.retention import (
    RetentionPolicy,
    encode_archive,
    episode_tokens,
    reduce_episode,
    tiered_stream,
)
from assay.engine.run_state import GradingStatus, RunView, TieringDue
from assay.kernel import (
    AssayError,
    BranchId,
    Lsn,
    RunId,
    RunState,
    TaskId,
    TenantId,
    run_transition,
)
from assay.kernel.schema import one_line
from assay.messages import Episode, EpisodeReduced, RunStatusChanged
from assay.record import BranchKey, Event, LogRecord
from assay.runtime import Gauge, UnitOfWork
from assay.store.ports import (
    BlobStore,
    BranchDeletion,
    CommitBatch,
    EventLog,
    OutboxEntry,
    StreamChanged,
)

log = logging.getLogger(__name__)

TIERING_QUEUE = TieringDue.kind
"""The document kind `fold_work` keeps per reduced, untiered run (`Reduced` puts it with
the reduction's time, `Tiered` deletes it): what the sweep reads."""
_PAGE = 10_000
_REMEMBERED = 10_000
"""Token counts of frozen episodes a process keeps for their results (a few hundred kB)."""


class ArchiveUnreadable(AssayError):
    """The archive read back is not what was written: nothing is deleted."""


class Retention:
    """Retention's per-process memory and its two steps: reduce a run whose grading
    ended (`grading_ended`), then tier the tenant's runs that are due (`sweep`)."""

    def __init__(self, policy: RetentionPolicy, clock: Callable[[], float] = time.time) -> None:
        self.policy = policy
        self._clock = clock
        self._swept: dict[TenantId, float] = {}
        """When each tenant's queue was last swept by this process."""
        self._tokens: OrderedDict[tuple[TenantId, str], int] = OrderedDict()
        """Tokens of episodes this process froze, by (tenant, blob ref), newest last."""

    def froze(self, tenant: TenantId, ref: str, episode: Episode) -> None:
        """Note the tokens of an episode just frozen as blob `ref`, so that its result
        needs no read of the blob when it is under the ceiling. A ref names its bytes
        (content-addressed), so the count can never go stale; a process that did not
        freeze the episode (a restart, another replica) reads the blob instead."""
        self._tokens[(tenant, ref)] = episode_tokens(episode)
        self._tokens.move_to_end((tenant, ref))
        while len(self._tokens) > _REMEMBERED:
            self._tokens.popitem(last=False)

    async def grading_ended(self, uow: UnitOfWork[Any], run: RunId, status: GradingStatus) -> None:
        """Grading of `run` ended: record it, and reduce the run if it is over its tenant's
        ceiling (the original blob is deleted once `Reduced` is durable)."""
        doc = await uow.get(RunView, run)
        if doc is None:
            log.info("retention: no run %s of tenant %s here", run, uow.tenant)
            return
        if doc.tiered:
            return
        events: list[Event] = [] if doc.grading else [GradingEnded(status=status)]
        reduction = None
        if doc.episode is not None and not doc.reduced:
            reduction = await self._reduction(uow, doc.episode)
            events += [reduction] if reduction is not None else []
        if not doc.grading and reduction is None and not doc.reduced:
            events.append(TieringQueued())  # under the ceiling: tiered unreduced, later
        if events:
            key = BranchKey.for_run(uow.tenant, run, BranchId(doc.branch))
            async with uow.step():  # `Reduced` is durable before the original goes
                for event in events:
                    uow.record(key, event)
                if reduction is not None:  # a reference on the task reads the summary now
                    uow.emit(VERIFIED, reduced_message(uow.tenant, run, doc.task_id, reduction))
        if (doc.reduced or reduction is not None) and doc.episode is not None:
            await uow.blobs.delete(uow.tenant, doc.episode)

    async def _reduction(self, uow: UnitOfWork[Any], ref: str) -> Reduced | None:
        """`Reduced`, its summary blob written, if the episode is over the ceiling."""
        ceiling = self.policy.ceiling_for(uow.tenant)
        tokens = self._tokens.pop((uow.tenant, ref), None)
        if tokens is not None and tokens <= ceiling:
            return None
        raw = await uow.blobs.get(uow.tenant, ref)
        if raw is None:
            log.warning("retention: episode %s of tenant %s is gone", ref, uow.tenant)
            return None
        try:
            episode = Episode.model_validate_json(raw)
        except ValidationError as exc:
            log.warning("retention: episode %s is not an episode: %s", ref, one_line(exc))
            return None
        if episode_tokens(episode) <= ceiling:
            return None
        summary = reduce_episode(episode, ref, self.policy.keep_chars)
        summary_ref = await uow.blobs.put(uow.tenant, summary.encode())
        return Reduced(
            original=ref,
            summary=summary_ref,
            tokens_before=summary.tokens_before,
            tokens_after=summary.tokens_after,
            ceiling=ceiling,
        )

    async def sweep(self, uow: UnitOfWork[Any]) -> list[RunId]:
        """Tier the tenant's reduced runs that are due (unless swept too recently);
        the runs tiered. A run that cannot be tiered now is left for a later sweep."""
        now = self._clock()
        last = self._swept.get(uow.tenant)
        if last is not None and now - last < self.policy.sweep_interval_s:
            return []
        self._swept[uow.tenant] = now
        cutoff_ms = (now - self.policy.tier_after_s) * 1000
        queue = await uow.scan(TieringDue)
        due = [RunId(run) for run, q in queue if q.reduced_ms <= cutoff_ms]
        tiered: list[RunId] = []
        for run in due[: self.policy.sweep_limit]:
            try:
                announce = partial(uow.sealed, RUN_STATUS)
                if await tier_run(uow.log, uow.blobs, uow.tenant, run, announce) is not None:
                    tiered.append(run)
            except StreamChanged as exc:  # written meanwhile, or moved by another worker
                log.info("retention: run %s not tiered now: %s", run, exc)
            except Exception:  # the result being handled is not this run's: never fail it
                log.warning("retention: tiering run %s failed", run, exc_info=True)
        return tiered


def reduced_message(tenant: TenantId, run: RunId, task: TaskId, r: Reduced) -> EpisodeReduced:
    """What tournament hears of a reduction: which blob now stands for the episode."""
    return EpisodeReduced(
        tenant=tenant, run_id=run, task_id=task, original=r.original, summary=r.summary
    )


async def tier_run(
    log_: EventLog,
    blobs: BlobStore,
    tenant: TenantId,
    run: RunId,
    announce: Callable[[RunStatusChanged], OutboxEntry] | None = None,
) -> Tiered | None:
    """Move a terminal run's records to an archive blob (see the module's docstring);
    the `Tiered` record committed, or None if the run is not eligible (unknown, grading
    not ended, already tiered).

    A graded or ungraded run reaches `Archived` (§5.2): with `announce`, its
    `RunStatusChanged` is sealed into the tiering commit, so the status goes out if
    and only if the records moved. A cancelled run stays `Cancelled` (terminal).

    Raises:
        StreamChanged: a record was appended to the run meanwhile; nothing was deleted.
        ArchiveUnreadable: the archive did not read back as written; nothing was deleted.
    """
    stored = await log_.get(RunView.at(tenant, run))
    doc = None if stored is None else RunView.model_validate(stored)
    if doc is None or doc.tiered or doc.grading is None:
        return None
    # Completes a reduction whose delete a crash interrupted (a no-op otherwise); an
    # episode never reduced is the run's only copy of it, and stays.
    if doc.reduced and doc.episode is not None:
        await blobs.delete(tenant, doc.episode)
    keys = [*await log_.branches(run, tenant), *await log_.branches(commands_stream(run), tenant)]
    branches = {key: await _read_all(log_, key) for key in keys}
    records = [r for recs in branches.values() for r in recs]
    archive = encode_archive(records)
    ref = await blobs.put(tenant, archive)
    if await blobs.get(tenant, ref) != archive:
        raise ArchiveUnreadable(f"archive {ref} of run {run} did not read back as written")
    event = Tiered(
        run=run,
        archive=ref,
        records=len(records),
        streams=[
            ArchivedBranch(stream=k.stream, branch=k.branch, records=len(recs))
            for k, recs in branches.items()
        ],
        documents=await _documents(log_, tenant, records),
    )
    status = _archived(doc.grading, records, ref)
    await log_.commit(
        CommitBatch(
            records=[(BranchKey.main(tenant, tiered_stream(run)), event)],
            deletions=[BranchDeletion(k, Lsn(len(recs))) for k, recs in branches.items()],
            outbox=[announce(status)] if announce is not None and status is not None else [],
        )
    )
    return event


def _archived(
    grading: GradingStatus, records: list[LogRecord], archive: str
) -> RunStatusChanged | None:
    """The run's `Archived` status, if its lifecycle reaches it from where grading left it
    (`Graded`, `Ungraded`); None for a cancelled run, or one with no start recorded."""
    ended = {"graded": RunState.GRADED, "ungraded": RunState.UNGRADED}.get(grading)
    started = next((r.event for r in records if isinstance(r.event, RunStarted)), None)
    if ended is None or started is None:
        return None
    state = run_transition(ended, RunState.ARCHIVED)
    return RunStatusChanged(
        run=started.run, state=state, detail=f"records moved to archive blob {archive}"
    )


async def _read_all(log_: EventLog, key: BranchKey) -> list[LogRecord]:
    records: list[LogRecord] = []
    while True:
        page = await log_.read(key, Lsn(records[-1].lsn + 1 if records else 0), _PAGE)
        records.extend(page)
        if len(page) < _PAGE:
            return records


async def _documents(
    log_: EventLog, tenant: TenantId, records: list[LogRecord]
) -> list[SnapshotDocument]:
    """Every document the records fold to, as the store holds it now (the queue entry
    aside: `Tiered` deletes it)."""
    touched = sorted({d.at for r in records for d in fold_work(r)})
    out: list[SnapshotDocument] = []
    for at in touched:
        if at.kind == TIERING_QUEUE or at.tenant != tenant:
            continue
        value = await log_.get(at)
        if value is not None:
            out.append(SnapshotDocument(kind=at.kind, key=at.key, value=value))
    return out


async def backlog_gauges(log: EventLog) -> list[Gauge]:
    """§15's retention backlog, per tenant: finished runs whose records wait to be tiered."""
    due = Counter(str(tenant) for tenant, _, _ in await log.scan_kind(TieringDue.kind))
    return [
        Gauge(
            "assay_retention_tiering_due",
            "Finished runs whose grading ended, waiting to be tiered (their records moved to "
            "blobs), "
            "per tenant.",
            ("tenant",),
            tuple(((tenant,), float(n)) for tenant, n in sorted(due.items())),
        )
    ]
