"""SIGKILL between checkpoint, release and resume of resident sandboxes (DESIGN §16), then
restart and check that nothing was lost and no step ran in a half-restored sandbox.

The workload is one workflow — write a file in the sandbox, call the stub model (0.6 s a
call; suspension after 0.1 s idle), read the file back — for three tasks: through
`assay demo` on SQLite, and through `assay serve execute` on Postgres beside the other
stages (the deployment of `test_crash_points`). Each test kills the process with
`ASSAY_CRASH_AT=<point>:<n>` at one boundary of the suspension protocol (the commits
of `SandboxStarted`, `SandboxCheckpointed`, `SandboxReleased`, and the points between
them), restarts it without, and checks:

- every task got exactly one result; every run finished once, succeeded, and read back
  the file it wrote (the workspace survived the release and the crash) — unless the
  kill cut a `command` call it had dispatched, which §8.4 makes `Indeterminate`;
- nothing committed before the crash was lost or changed;
- generations rise by one per run; every release follows a checkpoint of the same
  generation; after the crash every sandbox attempt ended in a generation started after
  the crash, with no checkpoint or release in between (never a half-restored sandbox);
- no resident sandbox process of any run is left.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections import Counter
from pathlib import Path

import pytest

from assay.bus import TASKS, WORKFLOWS
from assay.crash import CRASH_AT_ENV, CRASH_TRACE_ENV
from assay.kernel import WorkflowId, tenant_id
from assay.messages import TaskSubmitted, WorkflowRegistered
from assay.workflow import load_workflow
from tests.crash_checks import Attempt, ExecuteLog, Rec, _open_attempts
from tests.crash_processes import start_assay, stop
from tests.test_crash_points import (
    ExecuteStage,
    _await_disconnected,
    _demo_env,
    _output,
    _pg_log,
    _pg_results,
    _produce,
    _sqlite_log,
    _sqlite_results,
    _traced,
    _until,
    execute_stage,
    workload,
)

pytestmark = pytest.mark.slow

ITEMS = ["apple", "pear", "fig"]
WORKFLOW = """\
id: resident
description: {description}
steps:
  - id: write
    kind: tool
    tool: write_file
    args: {{path: note.txt, content: "{{{{ task.item }}}}"}}
  - id: think
    kind: model
    prompt: "What is 2 + 3? Answer with only the number."
  - id: read
    kind: tool
    tool: command
    args: {{argv: '["cat", "note.txt"]'}}
output: read
verifiers:
  - id: kept
    kind: regex
    step: read
    pattern: "^(apple|pear|fig)$"
"""
SUSPENSION = {
    "ASSAY_MODEL_STUB_DELAY_S": "0.6",
    "ASSAY_SANDBOX_SUSPEND_IDLE_AFTER_S": "0.1",
    "ASSAY_SANDBOX_RESIDENT_MEMORY_BYTES": str(4 << 20),
}
SANDBOX_STEPS = {"write", "read"}
POINTS = [
    "sandbox.after_restore:1",
    "sandbox.after_start:1",
    "execute.before_commit.SandboxStarted:1",
    "execute.after_commit.SandboxStarted:1",
    "execute.before_commit.SandboxCheckpointed:1",
    "execute.after_commit.SandboxCheckpointed:1",
    "sandbox.after_stop:1",
    "execute.before_commit.SandboxReleased:1",
    "execute.after_commit.SandboxReleased:1",
    # The second start of a branch is a resume (in a one-run-at-a-time demo, the first
    # run's; with runs interleaved, some run's second or first — both must recover).
    "sandbox.after_restore:4",
    "sandbox.after_start:4",
    "execute.after_commit.SandboxStarted:4",
]


__all__ = ["execute_stage", "workload"]  # the Postgres deployment's fixtures, used here


@pytest.fixture(scope="module")
def resident(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("resident-workload")
    v1, v2 = root / "v1.yaml", root / "v2.yaml"
    v1.write_text(WORKFLOW.format(description="Write, think, read back."))
    v2.write_text(WORKFLOW.format(description="The same, as the challenger."))
    tasks = root / "tasks.jsonl"
    tasks.write_text(
        "".join(
            json.dumps({"idempotency_key": f"task-{i}", "input": {"item": item}}) + "\n"
            for i, item in enumerate(ITEMS)
        )
    )
    return v1, v2, tasks


def _demo(w: tuple[Path, Path, Path], data: Path, env: dict[str, str], output: Path) -> int:
    v1, v2, tasks = w
    argv = ["--data-dir", str(data), "demo", "--no-progress", "--tasks", str(tasks)]
    proc = start_assay([*argv, "--workflows", str(v1), str(v2)], env, output, data.parent)
    proc.join(90)
    stop(proc)
    assert proc.exitcode is not None
    return proc.exitcode


def _residents_left(runs: set[str]) -> list[int]:
    """Live processes whose command line names one of `runs` (a resident's identity)."""
    left = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    line = f.read()
            except OSError:
                continue
            if any(run.encode() in line for run in runs):
                left.append(int(name))
    return left


def check_sandboxes(at_crash: ExecuteLog, final: ExecuteLog) -> None:
    """The suspension protocol's invariants over the log (see the module's description)."""
    before = at_crash.runs()
    unsafe_in_flight = {
        at
        for at, intent in _open_attempts(at_crash).items()
        if intent is not None and intent["state"] == "dispatched" and intent["effect"] == "unsafe"
    }
    for run, recs in final.runs().items():
        item = recs[0].doc["input"]["item"]
        kinds = Counter(r.type for r in recs)
        assert kinds["RunFinished"] == 1, (run, kinds)
        (finished,) = (r for r in recs if r.type == "RunFinished")
        if not finished.doc["succeeded"]:  # only by §8.4: an Unsafe call cut by the crash
            _assert_failed_by_the_crash(run, recs, unsafe_in_flight)
            continue
        assert [r.lsn for r in recs] == list(range(len(recs))), f"{run}: LSN gap"
        crashed_at = len(before.get(run, []))
        assert [(r.type, r.doc) for r in recs[:crashed_at]] == [
            (r.type, r.doc) for r in before.get(run, [])
        ], f"{run}: a record committed before the crash was lost or changed"
        generations = [r.doc["generation"] for r in recs if r.type == "SandboxStarted"]
        assert generations == list(range(1, len(generations) + 1)), (run, generations)
        up: tuple[int, int] | None = None  # (generation, index of its SandboxStarted)
        checkpointed: set[int] = set()
        for i, r in enumerate(recs):
            match r.type:
                case "SandboxStarted":
                    up = (r.doc["generation"], i)
                case "SandboxCheckpointed":
                    checkpointed.add(r.doc["generation"])
                    up = None
                case "SandboxReleased":
                    assert r.doc["generation"] in checkpointed, f"{run}: released unsaved"
                case "AttemptFinished" if r.doc["step"] in SANDBOX_STEPS:
                    ok = r.doc["state"] == "succeeded"
                    assert up is not None or not ok, f"{run}: {r.doc['step']} ran with no sandbox"
                    if ok and i >= crashed_at > 0:
                        assert up is not None
                        assert up[1] >= crashed_at, (
                            f"{run}: {r.doc['step']} ran in a generation the crash left behind"
                        )
        reads = [r for r in recs if r.type == "AttemptFinished" and r.doc["step"] == "read"]
        assert reads[-1].doc["output"] == item, f"{run}: read back {reads[-1].doc['output']!r}"


def _assert_failed_by_the_crash(run: str, recs: list[Rec], unsafe: set[Attempt]) -> None:
    """A run may fail only because the crash cut the `command` (Unsafe) call it had
    dispatched — `Indeterminate`, never retried (§8.4) — not because of its sandbox."""
    unknown = [
        (r.stream, r.doc["step"], int(r.doc["attempt"]))
        for r in recs
        if r.type == "AttemptFinished" and r.doc["state"] == "indeterminate"
    ]
    assert unknown, f"{run} failed, and not by an Unsafe call the crash cut"
    assert set(unknown) <= unsafe, f"{run}: {unknown} were not in flight at the crash"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("crash_at", POINTS)
def test_sigkill_during_suspension(
    crash_at: str, resident: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    workload = resident
    point = crash_at.rsplit(":", 1)[0]
    data, trace, output = tmp_path / "data", tmp_path / "trace", tmp_path / "output"
    env = _demo_env(tmp_path / "sink.jsonl", **SUSPENSION)
    crashed = _demo(
        workload, data, env | {CRASH_AT_ENV: crash_at, CRASH_TRACE_ENV: str(trace)}, output
    )
    assert point in _traced(trace), f"{point} never reached:\n{_output(output)}"
    assert crashed == -9, f"exit {crashed}, not SIGKILL, at {crash_at}:\n{_output(output)}"
    at_crash, _ = _sqlite_log(data / "execute.sqlite")

    assert _demo(workload, data, env, output) == 0, _output(output)
    results = _sqlite_results(data / "bus.sqlite")
    assert set(results) == {f"task-{i}" for i in range(len(ITEMS))}, "a task has no result"
    assert all(len(ids) == 1 for ids in results.values()), "a task got two different results"
    final, _ = _sqlite_log(data / "execute.sqlite")
    assert len(final.runs()) == len(ITEMS)
    check_sandboxes(at_crash, final)
    assert not _residents_left(set(final.runs())), "a resident sandbox outlived its worker"


def test_every_suspension_point_is_reached(
    resident: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    workload = resident
    trace, output = tmp_path / "trace", tmp_path / "output"
    env = _demo_env(tmp_path / "sink.jsonl", **SUSPENSION, **{CRASH_TRACE_ENV: str(trace)})
    assert _demo(workload, tmp_path / "data", env, output) == 0, _output(output)
    hits = Counter(_traced(trace))
    for crash_at in POINTS:
        point, n = crash_at.rsplit(":", 1)
        assert hits[point] >= int(n), f"{point} reached {hits[point]} times, not {n}"
    final, _ = _sqlite_log(tmp_path / "data" / "execute.sqlite")
    check_sandboxes(ExecuteLog([]), final)
    assert isinstance(final.records[0], Rec)


# -- Postgres: `assay serve execute` beside the other stages -------------------------------


@pytest.mark.postgres
@pytest.mark.kafka
@pytest.mark.s3
@pytest.mark.timeout(150)
@pytest.mark.parametrize("crash_at", POINTS)
async def test_postgres_sigkill_during_suspension(
    crash_at: str,
    execute_stage: ExecuteStage,
    resident: tuple[Path, Path, Path],
    tmp_path: Path,
) -> None:
    execute, point = execute_stage, crash_at.rsplit(":", 1)[0]
    d = execute.deployment
    trace, output = tmp_path / "trace", tmp_path / "output"
    crashing = execute.start(
        SUSPENSION | {CRASH_AT_ENV: crash_at, CRASH_TRACE_ENV: str(trace)}, output
    )
    tenant = str(uuid.uuid4())
    t = tenant_id(tenant)
    wf = load_workflow(resident[0])
    registered = WorkflowRegistered(tenant=t, definition=wf.model_dump(mode="json", by_alias=True))
    await _produce(d.bootstrap, [(WORKFLOWS, registered, t, wf.version)])

    async def allocated() -> bool:
        q = "SELECT 1 FROM ingest.state WHERE tenant = $1 AND kind = 'allocation'"
        return bool(await d.query(q, t))

    await _until("the workflow's allocation", allocated, 30)
    tasks = [
        TaskSubmitted(
            tenant=t,
            workflow_id=WorkflowId("resident"),
            idempotency_key=f"task-{i}",
            input={"item": item},
        )
        for i, item in enumerate(ITEMS)
    ]
    await _produce(d.bootstrap, [(TASKS, task, t, task.idempotency_key) for task in tasks])
    await asyncio.to_thread(crashing.join, 60)
    assert point in _traced(trace), f"{point} never reached:\n{_output(output)}"
    assert crashing.exitcode == -9, f"exit {crashing.exitcode} at {crash_at}:\n{_output(output)}"
    await _await_disconnected(d)
    at_crash = await _pg_log(d, tenant)

    execute.start(SUSPENSION, output)
    results = await _pg_results(d.bootstrap, tenant, len(ITEMS))
    assert set(results) == {task.idempotency_key for task in tasks}, "a task has no result"
    assert all(len(ids) == 1 for ids in results.values()), "a task got two different results"

    async def all_finished() -> bool:
        return len((await _pg_log(d, tenant)).finished()) == len(ITEMS)

    await _until("every run to finish", all_finished, 30)
    final = await _pg_log(d, tenant)
    check_sandboxes(at_crash, final)
    assert not _residents_left(set(final.runs())), "a resident sandbox outlived its worker"
