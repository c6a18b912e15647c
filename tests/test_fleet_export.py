"""`assay fleet export`: traces derived from the execute log, from a data directory and Postgres.

The derivation is pinned record by record on a hand-built log (exact times); the command
runs on the embedded demo's own data directory and on a log the real driver wrote to
Postgres.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from assay.cli import main
from assay.cli.demo import demo
from assay.devstack import Service
from assay.devstack.postgres import scratch_database
from assay.engine import (
    BUILTIN_TOOLS,
    WORK_EVENTS,
    AttemptFinished,
    AttemptStarted,
    Driver,
    LogJournal,
    RunFinished,
    RunSpec,
    RunStarted,
    StubModel,
    fold_work,
)
from assay.engine.events import (
    RunCancelled,
    SandboxCheckpointed,
    SandboxReleased,
    SandboxStarted,
    Signalled,
    Suspended,
)
from assay.fleet import WaitKind, parse_trace
from assay.fleet.export import Resources, trace_of_run
from assay.kernel import (
    AttemptNo,
    AttemptState,
    BranchId,
    Lsn,
    StepId,
    TaskId,
    content_hash,
    new_run_id,
    tenant_id,
)
from assay.messages import Purpose, Role, RunRef, Usage
from assay.record import BranchKey, Event, LogRecord
from assay.store import CommitBatch, SqliteEventLog
from assay.store.postgres import PostgresEventLog
from assay.workflow import WorkflowDef

TENANT = tenant_id("5b1f3c2e-8d4a-4e6b-9f0a-1c2d3e4f5a6b")
NO_USAGE = Usage()
DEFINITION = WorkflowDef.model_validate(
    {
        "id": "coder",
        "steps": [
            {"id": "plan", "kind": "model", "prompt": "plan {{ task.q }}"},
            {"id": "fetch", "kind": "tool", "tool": "http_request", "args": {}},
            {"id": "build", "kind": "tool", "tool": "command", "args": {}},
            {"id": "review", "kind": "await", "signal": "approval"},
        ],
    }
)


def ref(wf: WorkflowDef) -> RunRef:
    run = new_run_id()
    return RunRef(
        tenant=TENANT,
        run_id=run,
        task_id=TaskId(content_hash({"q": "x"})),
        idempotency_key=f"key-{run}",
        workflow_id=wf.id,
        workflow_version=wf.version,
        role=Role.CURRENT,
        purpose=Purpose.WORK,
    )


def records(r: RunRef, *timed: tuple[int, Event]) -> list[LogRecord]:
    started = RunStarted(run=r, definition=DEFINITION.model_dump(mode="json", by_alias=True))
    key = BranchKey(TENANT, r.run_id, BranchId(0))
    all_ = [(1_000, started), *((1_000 + t, e) for t, e in timed)]
    return [LogRecord(key, Lsn(i), 1, at, e) for i, (at, e) in enumerate(all_)]


def attempt(step: str, t0: int, t1: int) -> list[tuple[int, Event]]:
    s, n = StepId(step), AttemptNo(1)
    return [
        (t0, AttemptStarted(step=s, attempt=n, iteration=0, prompt="secret prompt")),
        (
            t1,
            AttemptFinished(
                step=s,
                attempt=n,
                state=AttemptState.SUCCEEDED,
                output="secret output",
                usage=NO_USAGE,
                duration_ms=t1 - t0,
            ),
        ),
    ]


def edges(trace_text: str) -> list[tuple[str, int, str]]:
    out = []
    for line in trace_text.splitlines()[1:]:
        doc = json.loads(line)
        out.append((doc["type"], doc["t_ms"], doc.get("kind", doc.get("outcome", ""))))
    return out


def test_model_tool_await_and_sandboxed_work_become_waits_and_busy_time() -> None:
    r = ref(DEFINITION)
    log = records(
        r,
        *attempt("plan", 10, 110),
        *attempt("fetch", 120, 170),
        *attempt("build", 170, 400),
        (400, Suspended(step=StepId("review"), iteration=0, signal="approval", deadline_ms=1)),
        (5_400, Signalled(step=StepId("review"), iteration=0, signal="approval", payload="ok")),
        (5_410, RunFinished(succeeded=True, episode="e", usage=NO_USAGE)),
    )
    trace = trace_of_run(log, Resources(2.0, 4.0))
    assert trace is not None
    text = trace.to_jsonl()
    assert "secret" not in text
    assert edges(text) == [
        ("run_started", 0, ""),
        ("wait_started", 10, "model"),
        ("wait_finished", 110, "model"),
        ("wait_started", 120, "tool"),
        ("wait_finished", 170, "tool"),
        ("busy_started", 170, ""),
        ("busy_finished", 400, ""),
        ("wait_started", 400, "human"),
        ("wait_finished", 5_400, "human"),
        ("run_finished", 5_410, "succeeded"),
    ]
    assert parse_trace(text, "x").header.cpu_cores == 2.0
    # a tool named as sandboxed is busy time, not a wait
    busy = trace_of_run(log, Resources(1, 1), frozenset({"command", "http_request"}))
    assert busy is not None
    assert [w.kind for w in busy.waits()] == [WaitKind.MODEL, WaitKind.HUMAN]


def test_a_pure_attempt_committed_with_its_start_spans_its_recorded_duration() -> None:
    """A Pure step's start and end are one commit (one time): its span is the duration
    it recorded, ending at that commit, never reaching back past the record before."""
    r = ref(DEFINITION)
    fetched = attempt("fetch", 0, 60)
    build = attempt("build", 0, 500)
    log = records(
        r,
        *attempt("plan", 10, 110),
        (170, fetched[0][1]),
        (170, fetched[1][1]),  # 60 ms of work, committed at 170
        (400, build[0][1]),
        (400, build[1][1]),  # recorded 500 ms: longer than since the record before
        (410, RunFinished(succeeded=True, episode="e", usage=NO_USAGE)),
    )
    trace = trace_of_run(log, Resources(1, 1))
    assert trace is not None
    assert edges(trace.to_jsonl()) == [
        ("run_started", 0, ""),
        ("wait_started", 10, "model"),
        ("wait_finished", 110, "model"),
        ("wait_started", 110, "tool"),
        ("wait_finished", 170, "tool"),
        ("busy_started", 170, ""),
        ("busy_finished", 400, ""),
        ("run_finished", 410, "succeeded"),
    ]


def test_overlapping_attempts_busy_wins_then_the_earliest_wait() -> None:
    r = ref(DEFINITION)
    log = records(
        r,
        (0, AttemptStarted(step=StepId("plan"), attempt=AttemptNo(1), iteration=0)),
        (50, AttemptStarted(step=StepId("fetch"), attempt=AttemptNo(1), iteration=0)),
        (100, AttemptStarted(step=StepId("build"), attempt=AttemptNo(1), iteration=0)),
        *attempt("build", 150, 150)[1:],
        *attempt("plan", 0, 200)[1:],
        *attempt("fetch", 50, 300)[1:],
        (90, RunCancelled(reason="stop", indeterminate=False, usage=NO_USAGE)),  # clock went back
    )
    trace = trace_of_run(log, Resources(1, 1))
    assert trace is not None
    assert edges(trace.to_jsonl()) == [
        ("run_started", 0, ""),
        ("wait_started", 0, "model"),
        ("wait_finished", 100, "model"),
        ("busy_started", 100, ""),
        ("busy_finished", 150, ""),
        ("wait_started", 150, "model"),
        ("wait_finished", 200, "model"),
        ("wait_started", 200, "tool"),
        ("wait_finished", 300, "tool"),
        ("run_finished", 300, "cancelled"),
    ]


def test_a_resume_is_taken_out_of_the_clock_the_release_changes_nothing() -> None:
    """A really suspended run exports the workload an always-on run of it has: the
    resume (generation 2's restore, start and verification) is the policy's cost,
    which the simulator charges itself; the first generation's start is the run's."""
    r = ref(DEFINITION)
    log = records(
        r,
        (5, SandboxStarted(generation=1, identity="g1", start_ms=5)),
        (10, AttemptStarted(step=StepId("plan"), attempt=AttemptNo(1), iteration=0)),
        (60, SandboxCheckpointed(generation=1, workspace="ws")),
        (70, SandboxReleased(generation=1, wait="model")),
        *attempt("plan", 10, 110)[1:],
        (150, SandboxStarted(generation=2, identity="g2", restored_from="ws", start_ms=40)),
        *attempt("build", 150, 400),
        (410, RunFinished(succeeded=True, episode="e", usage=NO_USAGE)),
    )
    trace = trace_of_run(log, Resources(1, 1))
    assert trace is not None
    assert edges(trace.to_jsonl()) == [
        ("run_started", 0, ""),
        ("wait_started", 10, "model"),
        ("wait_finished", 110, "model"),
        ("busy_started", 110, ""),
        ("busy_finished", 360, ""),
        ("run_finished", 370, "succeeded"),
    ]


def test_a_run_that_has_not_ended_has_no_trace() -> None:
    assert trace_of_run(records(ref(DEFINITION), *attempt("plan", 1, 2)), Resources(1, 1)) is None


def cli(*args: str) -> tuple[int, str, str]:
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as exit_:
            return int(exit_.code or 0), out.getvalue(), err.getvalue()
    raise AssertionError("main() returned without exiting")


@pytest.mark.slow
async def test_export_from_the_demo_data_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("ASSAY_DATABASE_URL", raising=False)
    data = tmp_path / "data"
    assert await demo(data, tasks=None, workflows=None, limit=4, progress=False) == 0
    capsys.readouterr()
    out_dir = tmp_path / "traces"
    code, out, err = await asyncio.to_thread(
        cli,
        "--data-dir",
        str(data),
        "fleet",
        "export",
        "--output",
        str(out_dir),
        "--cpu-cores",
        "2",
        "--memory-gib",
        "4",
    )
    assert code == 0, err
    summary = json.loads(out)
    files = sorted(out_dir.glob("*.jsonl"))
    assert summary["written"] == len(files) >= 4
    for f in files:
        assert f.stat().st_mode & 0o077 == 0
        trace = parse_trace(f.read_text(), str(f))
        assert trace.header.workflow_id == "arith"
        # The Pure tool step takes under a millisecond: its span (its recorded duration,
        # its start committed with its end) may be empty, and an empty wait is no wait.
        assert WaitKind.MODEL in {w.kind for w in trace.waits()}
        assert {w.kind for w in trace.waits()} <= {WaitKind.MODEL, WaitKind.TOOL}
    # only one version, by prefix; and nothing is written over an existing file
    version = parse_trace(files[0].read_text(), "f").header.workflow_version
    again = tmp_path / "v"
    code, out, _ = await asyncio.to_thread(
        cli,
        "--data-dir",
        str(data),
        "fleet",
        "export",
        "--output",
        str(again),
        "--version",
        version[:12],
    )
    assert code == 0
    assert 0 < json.loads(out)["written"] < len(files)
    before = {f: f.read_bytes() for f in files}
    code, out, err = await asyncio.to_thread(
        cli, "--data-dir", str(data), "fleet", "export", "--output", str(out_dir)
    )
    assert code == 2
    assert "refusing to overwrite" in err
    assert out == ""
    assert {f: f.read_bytes() for f in files} == before


@pytest.fixture(scope="module")
def export_database(postgres: Service) -> Iterator[str]:
    with scratch_database(postgres, "assay_fleet") as dsn:
        yield dsn


@pytest.mark.postgres
async def test_export_from_postgres_reads_what_the_driver_wrote(
    export_database: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ASSAY_DATABASE_URL", raising=False)
    wf = WorkflowDef.model_validate(
        {
            "id": "arith",
            "steps": [
                {"id": "solve", "kind": "model", "prompt": "What is {{ task.question }}?"},
                {
                    "id": "answer",
                    "kind": "tool",
                    "tool": "extract_number",
                    "args": {"text": "{{ steps.solve.output }}"},
                },
            ],
        }
    )
    log = await PostgresEventLog(export_database, "execute", WORK_EVENTS, fold_work).open()
    try:
        done: list[RunRef] = []
        for _ in range(2):
            r = ref(wf)
            spec = RunSpec(ref=r, definition=wf, input={"question": "2 + 3"}, branch=BranchId(0))
            episode = await Driver(StubModel(), BUILTIN_TOOLS).drive(spec, LogJournal(log))
            finished = RunFinished(succeeded=episode.succeeded, episode="e", usage=episode.usage)
            await log.commit(CommitBatch(records=[(spec.key, finished)]))
            done.append(r)
        unfinished = ref(wf)  # started, never finished: passed over
        await log.commit(
            CommitBatch(
                records=[
                    (BranchKey(TENANT, unfinished.run_id, BranchId(0)), RunStarted(run=unfinished))
                ]
            )
        )
    finally:
        await log.close()
    out_dir = tmp_path / "pg"
    code, out, err = await asyncio.to_thread(
        cli,
        "--data-dir",
        str(tmp_path / "none"),
        "fleet",
        "export",
        "--output",
        str(out_dir),
        "--database-url",
        export_database,
        "--tenant",
        str(TENANT),
        "--workflow",
        "arith",
    )
    assert code == 0, err
    assert json.loads(out) == {
        "directory": str(out_dir),
        "written": 2,
        "skipped": {"tiered": 0, "unfinished": 1},
    }
    for r in done:
        trace = parse_trace((out_dir / f"{r.run_id}.jsonl").read_text(), "pg")
        assert trace.header.workflow_version == wf.version
        assert [w.kind for w in trace.waits()] in (
            [WaitKind.MODEL, WaitKind.TOOL],
            [WaitKind.MODEL],
        )
    code, out, err = await asyncio.to_thread(
        cli,
        "--data-dir",
        str(tmp_path),
        "fleet",
        "export",
        "--output",
        str(tmp_path / "old"),
        "--database-url",
        export_database,
        "--until",
        "2000-01-01",
    )
    assert code == 0, err
    assert json.loads(out)["written"] == 0
    code, _, err = await asyncio.to_thread(
        cli,
        "--data-dir",
        str(tmp_path),
        "fleet",
        "export",
        "--output",
        str(tmp_path / "t"),
        "--database-url",
        export_database,
        "--since",
        "yesterday",
    )
    assert code == 2
    assert "--since must be an ISO 8601 time" in err


OTHER = tenant_id("9c8b7a6f-5e4d-4c3b-8a29-18f7e6d5c4b3")


async def test_runs_of_two_tenants_need_a_tenant_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ASSAY_DATABASE_URL", raising=False)
    data = tmp_path / "data"
    data.mkdir()
    log = await SqliteEventLog(data / "execute.sqlite", WORK_EVENTS, fold_work).open()
    try:
        for tenant in (TENANT, OTHER):
            r = ref(DEFINITION).model_copy(update={"tenant": tenant})
            key = BranchKey(tenant, r.run_id, BranchId(0))
            finished = RunFinished(succeeded=True, episode="e", usage=NO_USAGE)
            await log.commit(CommitBatch(records=[(key, RunStarted(run=r)), (key, finished)]))
    finally:
        await log.close()
    code, out, err = await asyncio.to_thread(
        cli, "--data-dir", str(data), "fleet", "export", "--output", str(tmp_path / "all")
    )
    assert (code, out) == (2, "")
    assert "belong to 2 tenants: name one with --tenant" in err
    assert not (tmp_path / "all").exists()
    code, out, err = await asyncio.to_thread(
        cli,
        "--data-dir",
        str(data),
        "fleet",
        "export",
        "--output",
        str(tmp_path / "one"),
        "--tenant",
        str(OTHER),
    )
    assert code == 0, err
    assert json.loads(out)["written"] == 1
