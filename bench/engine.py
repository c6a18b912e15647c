"""The engine against its peers: one durable step, beside DBOS Transact and LangGraph.

The same workflow — ten sequential Pure tool steps, each stripping a string — runs
200 times one after another (after 5 warm-ups) through three engines on the same
store: Assay's (`assay run`'s path: drive, episode blob, `RunFinished`), DBOS
Transact (`@DBOS.workflow` of ten `@DBOS.step`s) and LangGraph (a ten-node graph,
`durability="sync"`, its SQLite or Postgres checkpointer). SQLite runs in WAL mode
with `synchronous=FULL`, Postgres with `synchronous_commit=on` (checked). The
engines take turns, three rounds, and each figure is the median of its rounds.

The peers are a bench-only dependency group (`uv sync --group bench`; `make bench`
syncs it). `commits_figures` counts the store's transactions per step by effect
class on a real SQLite log.
"""

from __future__ import annotations

import asyncio
import sqlite3
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict

import asyncpg

from assay.engine import (
    BUILTIN_TOOLS,
    WORK_EVENTS,
    Driver,
    LogJournal,
    RunFinished,
    RunSpec,
    StubModel,
)
from assay.engine.events import fold_work
from assay.engine.tools import Pure, Tool, ToolCall, Unsafe
from assay.kernel import BranchId, TaskId, content_hash, new_run_id, tenant_id
from assay.messages import Purpose, Role, RunRef
from assay.store import EventLog, FsBlobStore, SqliteEventLog
from assay.store.postgres import PostgresEventLog
from assay.workflow import WorkflowDef, validate

STEPS = 10
WORKFLOWS = 200
WARM_UP = 5
ROUNDS = 3
TEXT = "  a short string, stripped at every step  "
TENANT = tenant_id(uuid.UUID("00000000-0000-4000-8000-00000000e061"))


def ten_steps(tool: str, steps: int = STEPS) -> WorkflowDef:
    """`steps` tool steps in a row, each handing its output to the next."""
    chain = [
        {
            "id": f"s{i}",
            "kind": "tool",
            "tool": tool,
            "args": {"text": "{{ task.text }}" if i == 0 else f"{{{{ steps.s{i - 1}.output }}}}"},
        }
        for i in range(steps)
    ]
    return validate(WorkflowDef.model_validate({"id": f"bench-{tool}-{steps}", "steps": chain}))


def _spec(wf: WorkflowDef) -> RunSpec:
    run_id = new_run_id()
    ref = RunRef(
        tenant=TENANT,
        run_id=run_id,
        task_id=TaskId(content_hash({"text": TEXT})),
        idempotency_key=run_id,
        workflow_id=wf.id,
        workflow_version=wf.version,
        role=Role.CURRENT,
        purpose=Purpose.WORK,
    )
    return RunSpec(ref=ref, definition=wf, input={"text": TEXT}, branch=BranchId(0))


async def assay_run(driver: Driver, log: EventLog, blobs: FsBlobStore, wf: WorkflowDef) -> None:
    """One run as `assay run` makes it: drive, store the episode blob, commit `RunFinished`."""
    spec = _spec(wf)
    journal = LogJournal(log, defers=True)  # as `assay run`: Pure steps ride with RunFinished
    episode = await driver.drive(spec, journal)
    assert episode.succeeded, episode.failed_step
    blob = await blobs.put(TENANT, episode.encode())
    finished = RunFinished(
        succeeded=episode.succeeded,
        failed_step=episode.failed_step,
        episode=blob,
        usage=episode.usage,
    )
    await journal.record_and_commit(spec.key, finished)


async def _assay_steps_per_s(log: EventLog, blobs: FsBlobStore) -> float:
    wf = ten_steps("strip")
    driver = Driver(StubModel(), BUILTIN_TOOLS)
    for _ in range(WARM_UP):
        await assay_run(driver, log, blobs, wf)
    t0 = time.perf_counter()
    for _ in range(WORKFLOWS):
        await assay_run(driver, log, blobs, wf)
    return WORKFLOWS * STEPS / (time.perf_counter() - t0)


def assay_sqlite(path: Path) -> float:
    """Assay's steps per second on a SQLite log (WAL, `synchronous=FULL`)."""

    async def go() -> float:
        log = await SqliteEventLog(path / "assay.sqlite", WORK_EVENTS, fold_work).open()
        try:
            return await _assay_steps_per_s(log, FsBlobStore(path / "blobs"))
        finally:
            await log.close()

    return asyncio.run(go())


def assay_postgres(dsn: str, path: Path) -> float:
    """Assay's steps per second on a Postgres log (episode blobs on the local disk)."""

    async def go() -> float:
        log = await PostgresEventLog(dsn, "execute", WORK_EVENTS, fold_work).open()
        try:
            return await _assay_steps_per_s(log, FsBlobStore(path / "blobs"))
        finally:
            await log.close()

    return asyncio.run(go())


# -- DBOS Transact ------------------------------------------------------------------------

_dbos_workflow: Callable[[str], str] | None = None


def _dbos_registered() -> Callable[[str], str]:
    """The ten-step DBOS workflow, registered once per process (DBOS keeps a registry)."""
    global _dbos_workflow
    if _dbos_workflow is None:
        from dbos import DBOS

        def strip(text: str) -> str:
            return text.strip()

        # Registered by call, not as decorators: the bench type-checks without the peers.
        strip_step: Callable[[str], str] = DBOS.step()(strip)

        def ten(text: str) -> str:
            for _ in range(STEPS):
                text = strip_step(text)
            return text

        _dbos_workflow = DBOS.workflow()(ten)
    return _dbos_workflow


def dbos_steps_per_s(system_database_url: str) -> float:
    """DBOS Transact's steps per second with its system database at the URL."""
    from dbos import DBOS

    workflow = _dbos_registered()
    DBOS(
        config={
            "name": "assay-bench",
            "system_database_url": system_database_url,
            "log_level": "WARNING",
        }
    )
    DBOS.launch()
    try:
        for _ in range(WARM_UP):
            assert workflow(TEXT) == TEXT.strip()
        t0 = time.perf_counter()
        for _ in range(WORKFLOWS):
            workflow(TEXT)
        return WORKFLOWS * STEPS / (time.perf_counter() - t0)
    finally:
        DBOS.destroy(destroy_registry=False)


# -- LangGraph ----------------------------------------------------------------------------


class _Text(TypedDict):
    text: str


def _graph(checkpointer: Any) -> Any:
    from langgraph.graph import END, START, StateGraph

    graph = StateGraph(_Text)
    previous = START
    for i in range(STEPS):
        graph.add_node(f"s{i}", lambda state: {"text": state["text"].strip()})
        graph.add_edge(previous, f"s{i}")
        previous = f"s{i}"
    graph.add_edge(previous, END)
    return graph.compile(checkpointer=checkpointer)


def _langgraph_steps_per_s(checkpointer: Any) -> float:
    app = _graph(checkpointer)

    def invoke() -> None:
        config = {"configurable": {"thread_id": str(uuid.uuid4())}}
        out = app.invoke({"text": TEXT}, config, durability="sync")
        assert out["text"] == TEXT.strip()

    for _ in range(WARM_UP):
        invoke()
    t0 = time.perf_counter()
    for _ in range(WORKFLOWS):
        invoke()
    return WORKFLOWS * STEPS / (time.perf_counter() - t0)


def langgraph_sqlite(path: Path) -> float:
    """LangGraph's steps per second with its SQLite checkpointer (WAL, `synchronous=FULL`)."""
    from langgraph.checkpoint.sqlite import SqliteSaver

    conn = sqlite3.connect(path / "langgraph.sqlite", check_same_thread=False)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        saver = SqliteSaver(conn)
        saver.setup()
        return _langgraph_steps_per_s(saver)
    finally:
        conn.close()


def langgraph_postgres(dsn: str) -> float:
    """LangGraph's steps per second with its Postgres checkpointer."""
    from langgraph.checkpoint.postgres import PostgresSaver

    with PostgresSaver.from_conn_string(dsn) as saver:
        saver.setup()
        return _langgraph_steps_per_s(saver)


# -- the section --------------------------------------------------------------------------


def _wal_full(path: Path) -> str:
    """A SQLite URL for DBOS: the file is put in WAL mode first (the mode is stored in
    the file); a fresh connection's `synchronous` is FULL, checked."""
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA journal_mode=WAL").fetchone() == ("wal",)
        assert conn.execute("PRAGMA synchronous").fetchone() == (2,), "not synchronous=FULL"
    finally:
        conn.close()
    return f"sqlite:///{path}"


def _medians(rounds: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in rounds.items()}


def _figures(backend: str, medians: dict[str, float]) -> dict[str, float]:
    ours = medians["assay"]
    better = max(medians["dbos"], medians["langgraph"])
    return {
        f"engine.steps_per_s.{backend}": round(ours, 1),
        f"engine.dbos_steps_per_s.{backend}": round(medians["dbos"], 1),
        f"engine.langgraph_steps_per_s.{backend}": round(medians["langgraph"], 1),
        f"engine.peer_ratio.{backend}": round(ours / better, 3),
    }


def _interleaved(engines: dict[str, Callable[[int], float]]) -> dict[str, float]:
    """Each engine once per round, the order rotated round by round; medians."""
    rounds: dict[str, list[float]] = {name: [] for name in engines}
    names = list(engines)
    for r in range(ROUNDS):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            rate = engines[name](r)
            rounds[name].append(rate)
            print(f"  engine round {r + 1} {name}: {rate:.0f} steps/s")
    return _medians(rounds)


def sqlite_figures(tmp: Path) -> dict[str, float]:
    """The three engines on SQLite, each round in fresh files."""

    def where(r: int, name: str) -> Path:
        d = tmp / f"sqlite-{r}-{name}"
        d.mkdir(parents=True)
        return d

    medians = _interleaved(
        {
            "assay": lambda r: assay_sqlite(where(r, "assay")),
            "dbos": lambda r: dbos_steps_per_s(_wal_full(where(r, "dbos") / "dbos.sqlite")),
            "langgraph": lambda r: langgraph_sqlite(where(r, "langgraph")),
        }
    )
    return _figures("sqlite", medians)


async def _fresh_databases(admin_dsn: str, names: list[str]) -> list[str]:
    from assay.devstack.postgres import create_database

    return [await create_database(admin_dsn, name) for name in names]


async def _synchronous_commit(dsn: str) -> str:
    conn = await asyncpg.connect(dsn)
    try:
        return str(await conn.fetchval("SHOW synchronous_commit"))
    finally:
        await conn.close()


def postgres_figures(admin_dsn: str, tmp: Path) -> dict[str, float]:
    """The three engines on Postgres, each round in fresh databases."""
    from assay.devstack.postgres import drop_database

    tag = uuid.uuid4().hex[:8]
    names = {
        (r, name): f"assay_bench_engine_{tag}_{r}_{name}"
        for r in range(ROUNDS)
        for name in ("assay", "dbos", "langgraph")
    }
    dsns = dict(
        zip(names, asyncio.run(_fresh_databases(admin_dsn, list(names.values()))), strict=True)
    )
    setting = asyncio.run(_synchronous_commit(dsns[(0, "assay")]))
    assert setting == "on", f"synchronous_commit is {setting}, not on"
    try:
        medians = _interleaved(
            {
                "assay": lambda r: assay_postgres(dsns[(r, "assay")], tmp / f"pg-{r}"),
                "dbos": lambda r: dbos_steps_per_s(dsns[(r, "dbos")]),
                "langgraph": lambda r: langgraph_postgres(dsns[(r, "langgraph")]),
            }
        )
    finally:

        async def drop() -> None:
            for name in names.values():
                await drop_database(admin_dsn, name)

        asyncio.run(drop())
    return _figures("postgres", medians)


# -- commits per step, by effect class ----------------------------------------------------


async def _stamp(call: ToolCall) -> str:
    return call.args.get("text", "")


COUNTED_TOOLS = {
    "pure_stamp": Tool("pure_stamp", _stamp, Pure(), "Returns `text` (Pure)."),
    "unsafe_stamp": Tool("unsafe_stamp", _stamp, Unsafe(), "Returns `text` (Unsafe)."),
}


async def _transactions_of_a_run(log: SqliteEventLog, wf: WorkflowDef) -> int:
    """A whole run's transactions, as `assay run` commits it: its end included."""
    before = log.transactions
    spec = _spec(wf)
    journal = LogJournal(log, defers=True)
    episode = await Driver(StubModel(), COUNTED_TOOLS).drive(spec, journal)
    finished = RunFinished(succeeded=episode.succeeded, episode="-", usage=episode.usage)
    await journal.record_and_commit(spec.key, finished)
    return log.transactions - before


async def commits_per_step(path: Path, tool: str) -> float:
    """The store transactions one more step of `tool` costs: those of an 11-step run
    less those of a 1-step run, over 10 — counted by the log, not derived."""
    log = await SqliteEventLog(path, WORK_EVENTS, fold_work).open()
    try:
        long = await _transactions_of_a_run(log, ten_steps(tool, STEPS + 1))
        short = await _transactions_of_a_run(log, ten_steps(tool, 1))
    finally:
        await log.close()
    return (long - short) / STEPS


def commits_figures(tmp: Path) -> dict[str, float]:
    """`engine.commits_per_step.{pure,unsafe}` on a real SQLite log."""

    async def go() -> dict[str, float]:
        return {
            "engine.commits_per_step.pure": await commits_per_step(
                tmp / "commits-pure.sqlite", "pure_stamp"
            ),
            "engine.commits_per_step.unsafe": await commits_per_step(
                tmp / "commits-unsafe.sqlite", "unsafe_stamp"
            ),
        }

    return asyncio.run(go())


def engine_figures(tmp: Path, admin_dsn: str | None) -> dict[str, float]:
    """Every figure of the section; the Postgres ones only with a server."""
    tmp.mkdir(parents=True, exist_ok=True)
    figures = commits_figures(tmp)
    figures.update(sqlite_figures(tmp))
    if admin_dsn is not None:
        figures.update(postgres_figures(admin_dsn, tmp))
    return figures
