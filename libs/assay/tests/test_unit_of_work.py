"""The unit of work a handler gets: routes from annotations, typed state, explicit
part-way commits, and fencing as an argument."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from pydantic import Field

from assay.bus.topics import EPISODES, RUN_COMMANDS, TASKS
from assay.kernel import WorkflowId, tenant_id
from assay.messages import CancelRun, RunExecuted, TaskSubmitted, message_id, seal
from assay.record import BranchKey, Event, EventRegistry, LogRecord, ReadModel, StateDelta
from assay.runtime import HandlerInvalid, UnitOfWork, routes
from assay.store import SqliteEventLog, StaleFence
from assay.store.fs_blobs import FsBlobStore

TENANT = tenant_id(uuid.UUID(int=11))
OTHER = tenant_id(uuid.UUID(int=12))


class Counted(Event):
    type: ClassVar[str] = "uowtest.Counted"
    version: ClassVar[int] = 1
    name: str
    n: int


class Tally(ReadModel):
    kind: ClassVar[str] = "tally"
    n: int
    names: list[str] = Field(default_factory=list)


def fold(record: LogRecord) -> list[StateDelta]:
    match record.event:
        case Counted() as e:
            return [Tally(n=e.n, names=[e.name]).put(record.key.tenant, e.name)]
    return []


REGISTRY = EventRegistry([Counted])


@pytest.fixture
async def log(tmp_path: Path) -> AsyncIterator[SqliteEventLog]:
    store = await SqliteEventLog(tmp_path / "uow.sqlite", REGISTRY, fold).open()
    yield store
    await store.close()


def unit(log: SqliteEventLog, tmp_path: Path, deps: Any = None) -> UnitOfWork[Any]:
    task = TaskSubmitted(tenant=TENANT, workflow_id=WorkflowId("wf"), idempotency_key="k", input={})
    env = seal(task, tenant=TENANT, key="k", id=message_id("t", "k"), causation=None)
    return UnitOfWork("uowtest", log, FsBlobStore(tmp_path / "blobs"), env, deps=deps)


# -- routes ---------------------------------------------------------------------------------


async def on_task(msg: TaskSubmitted, uow: UnitOfWork[Any]) -> None:
    """A task."""


async def on_cancel(msg: CancelRun, uow: UnitOfWork[Any]) -> None:
    """A cancel."""


async def on_executed(msg: RunExecuted, uow: UnitOfWork[Any]) -> None:
    """An episode."""


async def unannotated(msg, uow) -> None:  # type: ignore[no-untyped-def]
    """No message type."""


async def on_counted(msg: Counted, uow: UnitOfWork[Any]) -> None:
    """An event, which no topic carries."""


def test_a_handlers_annotation_is_its_route() -> None:
    assert routes(on_task, on_cancel, on_executed) == {
        TASKS: {TaskSubmitted.type: on_task},
        RUN_COMMANDS: {CancelRun.type: on_cancel},
        EPISODES: {RunExecuted.type: on_executed},
    }


def test_a_bound_methods_annotation_is_its_route() -> None:
    class Handlers:
        async def on_cancel(self, msg: CancelRun, uow: UnitOfWork[Any]) -> None:
            """A cancel."""

    bound = Handlers().on_cancel
    assert routes(bound) == {RUN_COMMANDS: {CancelRun.type: bound}}


@pytest.mark.parametrize(
    ("handlers", "message"),
    [
        ((unannotated,), "names no message type"),
        ((on_counted,), "no topic carries Counted"),
        ((on_task, on_task), "two handlers take TaskSubmitted"),
    ],
)
def test_a_handler_that_cannot_be_routed_is_refused(handlers: Any, message: str) -> None:
    with pytest.raises(HandlerInvalid, match=message):
        routes(*handlers)


# -- typed state and part-way commits -------------------------------------------------------


async def test_state_reads_back_as_its_read_model(log: SqliteEventLog, tmp_path: Path) -> None:
    uow = unit(log, tmp_path)
    assert await uow.get(Tally, "a") is None
    await uow.record_and_commit(BranchKey.main(TENANT, "s"), Counted(name="a", n=3))
    assert await uow.get(Tally, "a") == Tally(n=3, names=["a"])
    assert await uow.scan(Tally) == [("a", Tally(n=3, names=["a"]))]


async def test_a_step_commits_at_its_end_and_not_if_it_raises(
    log: SqliteEventLog, tmp_path: Path
) -> None:
    uow = unit(log, tmp_path)
    key = BranchKey.main(TENANT, "s")
    async with uow.step():
        uow.record(key, Counted(name="a", n=1))
        assert await uow.get(Tally, "a") is None, "nothing is durable inside the block"
    assert await uow.get(Tally, "a") == Tally(n=1, names=["a"])

    async def failing() -> None:
        async with uow.step():
            uow.record(key, Counted(name="b", n=2))
            raise RuntimeError("the handler failed")

    with pytest.raises(RuntimeError):
        await failing()
    uow.discard()  # as the consumer does before it runs the handler again
    assert await uow.get(Tally, "b") is None
    assert uow.committed == 1


async def test_a_unit_of_work_writes_only_its_own_tenant(
    log: SqliteEventLog, tmp_path: Path
) -> None:
    from assay.kernel import Refused

    with pytest.raises(Refused, match="cannot write"):
        unit(log, tmp_path).record(BranchKey.main(OTHER, "s"), Counted(name="a", n=1))


async def test_deps_are_what_the_stage_shares(log: SqliteEventLog, tmp_path: Path) -> None:
    uow: UnitOfWork[dict[str, int]] = unit(log, tmp_path, deps={"limit": 3})
    assert uow.deps == {"limit": 3}
    assert uow.fenced(await _lease(log, "w")).deps is uow.deps


# -- fencing --------------------------------------------------------------------------------


async def _lease(log: SqliteEventLog, worker: str) -> Any:
    lease = await log.claim(TENANT, "run-1", worker, 60_000)
    assert lease is not None
    return lease


async def test_writes_through_a_fenced_view_commit_only_under_its_lease(
    log: SqliteEventLog, tmp_path: Path
) -> None:
    uow = unit(log, tmp_path)
    lease = await _lease(log, "w")
    fenced = uow.fenced(lease)
    key = BranchKey.main(TENANT, "s")
    fenced.record(key, Counted(name="a", n=1))
    assert uow.take().fence == lease, "the pending write keeps its fence on the shared batch"
    await log.release(lease)
    await log.claim(TENANT, "run-1", "another", 60_000)  # taken over: a newer fence
    fenced.record(key, Counted(name="b", n=2))
    with pytest.raises(StaleFence):
        await uow.commit()  # the message's final commit carries the fenced write
    assert await uow.get(Tally, "b") is None


async def test_writes_outside_the_fence_are_not_checked(
    log: SqliteEventLog, tmp_path: Path
) -> None:
    uow = unit(log, tmp_path)
    lease = await _lease(log, "w")
    uow.fenced(lease)  # a view that writes nothing fences nothing
    uow.record(BranchKey.main(TENANT, "s"), Counted(name="a", n=1))
    assert uow.take().fence is None


async def test_a_released_view_drops_the_fence_of_what_is_pending(
    log: SqliteEventLog, tmp_path: Path
) -> None:
    uow = unit(log, tmp_path)
    fenced = uow.fenced(await _lease(log, "w"))
    fenced.emit(TASKS, TaskSubmitted(tenant=TENANT, workflow_id=WorkflowId("wf"),
                                     idempotency_key="k2", input={}))  # fmt: skip
    released = fenced.released()
    released.record(BranchKey.main(TENANT, "s"), Counted(name="a", n=1))
    batch = uow.take()
    assert batch.fence is None
    assert len(batch.outbox) == 1
    assert len(batch.records) == 1


# -- what happens once a commit lands -------------------------------------------------------


async def test_on_landed_runs_after_the_commit_and_never_for_dropped_writes(
    log: SqliteEventLog, tmp_path: Path
) -> None:
    """A count kept outside the transaction counts a handler run again after a failure
    once: a dropped attempt's hooks go with its writes."""
    done: list[str] = []
    first = unit(log, tmp_path)
    first.record(BranchKey.main(TENANT, "s"), Counted(name="a", n=1))
    first.on_landed(lambda: done.append("first"))
    first.discard()  # the handler failed: it runs again on a new unit of work
    again = unit(log, tmp_path)
    again.record(BranchKey.main(TENANT, "s"), Counted(name="a", n=1))
    again.on_landed(lambda: done.append("again"))
    assert done == []
    await again.commit()
    assert done == ["again"]
    await again.commit()  # nothing more pending: the hook does not run twice
    assert done == ["again"]
