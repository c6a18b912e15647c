"""Resident sandboxes released while a run waits, and restored as verified generations
(DESIGN §16): real local sandboxes, real processes, the execute log on SQLite and Postgres."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from assay.engine import AttemptFinished, Driver, LogJournal, StubModel
from assay.engine.driver import RunSuspended
from assay.engine.events import (
    SandboxCheckpointed,
    SandboxReleased,
    SandboxStarted,
    Signalled,
    Suspended,
)
from assay.engine.sandbox_tools import sandbox_tools
from assay.engine.suspension import ResumeRefused, SuspendPolicy, Suspension
from assay.engine.tools import BUILTIN_TOOLS
from assay.kernel import BranchId, RunId, TaskId, content_hash, new_run_id, tenant_id
from assay.messages import Purpose, Role, RunRef
from assay.record import BranchKey, Event
from assay.sandbox import Limits, LocalSandbox, SandboxError
from assay.sandbox.resident import LocalResident
from assay.store import FsBlobStore
from assay.store.ports import EventLog
from assay.workflow import WorkflowDef, validate

TENANT = tenant_id(uuid.UUID("0b5e7a31-7c55-4c1e-9d0a-3e1f2a4b5c6d"))
TOOLS = {**BUILTIN_TOOLS, **sandbox_tools()}
POLICY = SuspendPolicy(idle_after_s=0.05, resident_memory_bytes=8 << 20)
SLOW = 0.6
"""Seconds each model call takes: much longer than `idle_after_s`."""

WRITE: dict[str, Any] = {"id": "write", "kind": "tool", "tool": "write_file"}
WRITE["args"] = {"path": "a.txt", "content": "kept"}
READ = {"id": "read", "kind": "tool", "tool": "command", "args": {"argv": '["cat", "a.txt"]'}}
THINK = {"id": "think", "kind": "model", "prompt": "What is 2 + 3? Say only the number."}
ASK = {"id": "ask", "kind": "await", "signal": "approval", "timeout_s": 600}


def spec_for(steps: list[dict[str, Any]], output: str = "read") -> Any:
    from assay.engine import RunSpec

    doc = {"id": "resident", "steps": steps, "output": output}
    wf = validate(WorkflowDef.model_validate(doc), frozenset(TOOLS))
    run_id = new_run_id()
    ref = RunRef(
        tenant=TENANT,
        run_id=run_id,
        task_id=TaskId(content_hash({})),
        idempotency_key=f"k-{run_id}",
        workflow_id=wf.id,
        workflow_version=wf.version,
        role=Role.CURRENT,
        purpose=Purpose.WORK,
    )
    return RunSpec(ref=ref, definition=wf, input={}, branch=BranchId(0))


@pytest.fixture
def sandbox(tmp_path: Path) -> LocalSandbox:
    return LocalSandbox(tmp_path / "sandbox", FsBlobStore(tmp_path / "blobs"))


def driver(sandbox: LocalSandbox, delay_s: float = SLOW, policy: SuspendPolicy = POLICY) -> Driver:
    suspension = Suspension(sandbox, policy)
    return Driver(StubModel(delay_s=delay_s), TOOLS, sandbox, suspension=suspension)


async def events(log: EventLog, key: BranchKey) -> list[Event]:
    return [r.event for r in await log.read(key)]


def residents_of(run: RunId) -> list[int]:
    """Processes alive whose command line names the run (a resident's identity does)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if str(run).encode() in f.read():
                        found.append(int(name))
            except OSError:
                continue
    return found


def sandbox_order(evs: list[Event]) -> list[str]:
    """The sandbox records and the sandbox steps' attempt ends, in log order (an
    attempt's call is made after its workspace is ready, so after `SandboxStarted`)."""
    out = []
    for ev in evs:
        match ev:
            case SandboxStarted(generation=g):
                out.append(f"started {g}")
            case SandboxCheckpointed(generation=g):
                out.append(f"checkpointed {g}")
            case SandboxReleased(generation=g, wait=kind):
                out.append(f"released {g} {kind}")
            case AttemptFinished(step=step) if step != "think":
                out.append(step)
            case Suspended():
                out.append("suspended")
    return out


def metric(s: Suspension, name: str, **labels: str) -> float:
    value = s.metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


async def test_a_long_model_wait_releases_the_sandbox_and_the_next_step_gets_it_back(
    work_log: EventLog, sandbox: LocalSandbox
) -> None:
    spec = spec_for([WRITE, THINK, READ])
    d = driver(sandbox)
    assert d.suspension is not None
    episode = await d.drive(spec, LogJournal(work_log))
    assert episode.succeeded, episode.attempts
    assert episode.output == "kept"  # the file survived the release
    evs = await events(work_log, spec.key)
    assert sandbox_order(evs) == [
        "started 1",
        "write",
        "checkpointed 1",
        "released 1 model",
        "started 2",
        "read",
    ]
    checkpoint = next(e for e in evs if isinstance(e, SandboxCheckpointed))
    written = next(e for e in evs if isinstance(e, AttemptFinished) and e.step == "write")
    second = [e for e in evs if isinstance(e, SandboxStarted)][1]
    assert checkpoint.workspace == written.workspace  # the same contents, the same ref
    assert second.restored_from == checkpoint.workspace
    assert second.identity.startswith(f"{TENANT}/{spec.ref.run_id}/0/g2/")
    assert not residents_of(spec.ref.run_id), "a resident sandbox outlived its run"
    s = d.suspension
    assert metric(s, "assay_sandbox_suspensions_total", kind="model") == 1
    assert metric(s, "assay_sandbox_resumes_total") == 1
    assert metric(s, "assay_sandbox_resume_seconds_count") == 1
    assert metric(s, "assay_sandbox_resident_memory_byte_seconds_total") > 0


async def test_a_model_call_shorter_than_idle_after_keeps_the_sandbox(
    work_log: EventLog, sandbox: LocalSandbox
) -> None:
    spec = spec_for([WRITE, THINK, READ])
    d = driver(sandbox, delay_s=0.0, policy=SuspendPolicy(idle_after_s=30))
    episode = await d.drive(spec, LogJournal(work_log))
    assert episode.output == "kept"
    assert sandbox_order(await events(work_log, spec.key)) == ["started 1", "write", "read"]


async def test_an_await_releases_the_sandbox_before_the_wait_is_recorded(
    work_log: EventLog, sandbox: LocalSandbox
) -> None:
    spec = spec_for([WRITE, ASK, READ])
    journal = LogJournal(work_log)
    with pytest.raises(RunSuspended):
        await driver(sandbox).drive(spec, journal)
    assert not residents_of(spec.ref.run_id), "a suspended run still holds its sandbox"
    assert sandbox_order(await events(work_log, spec.key))[-3:] == [
        "checkpointed 1",
        "released 1 human",
        "suspended",
    ]
    await journal.record_and_commit(
        spec.key, Signalled(step="ask", iteration=0, signal="approval", payload="yes")
    )
    episode = await driver(sandbox).drive(spec, journal)  # another worker resumes it
    assert episode.output == "kept"
    assert sandbox_order(await events(work_log, spec.key))[-2:] == ["started 2", "read"]


async def test_a_crash_after_the_checkpoint_resumes_in_a_new_generation(
    work_logs: Any, sandbox: LocalSandbox
) -> None:
    """The worker dies after `SandboxCheckpointed` (its resident process dies with it in a
    real crash; here the drive's end stops it). The next worker starts generation 2 from
    the checkpoint before the read."""
    spec = spec_for([WRITE, THINK, READ])
    log = await work_logs.open()

    class DiesAfterCheckpoint(LogJournal):
        async def record_and_commit(self, key: Any, *evs: Event, emits: Any = ()) -> None:
            await super().record_and_commit(key, *evs, emits=emits)
            if any(isinstance(e, SandboxCheckpointed) for e in evs):
                raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await driver(sandbox).drive(spec, DiesAfterCheckpoint(log))
    assert not residents_of(spec.ref.run_id)
    episode = await driver(sandbox).drive(spec, LogJournal(await work_logs.open()))
    assert episode.output == "kept"
    order = sandbox_order(await events(log, spec.key))
    assert order[:3] == ["started 1", "write", "checkpointed 1"], order
    assert order[-2:] == ["started 2", "read"], order  # never a step before the new generation


class Impostor(LocalSandbox):
    """Starts residents that announce themselves and then answer as someone else."""

    async def start_resident(self, workspace: Any, **kw: Any) -> LocalResident:
        resident = await super().start_resident(workspace, **kw)
        resident.identity = resident.identity + "-not"
        return resident


async def test_a_generation_that_answers_with_another_identity_runs_no_step(
    work_log: EventLog, tmp_path: Path
) -> None:
    sandbox = Impostor(tmp_path / "sandbox", FsBlobStore(tmp_path / "blobs"))
    spec = spec_for([WRITE, READ])
    with pytest.raises(ResumeRefused, match="answered"):
        await driver(sandbox).drive(spec, LogJournal(work_log))
    evs = await events(work_log, spec.key)
    assert not any(isinstance(e, SandboxStarted | AttemptFinished) for e in evs)
    assert not residents_of(spec.ref.run_id)


async def test_a_resident_holds_its_memory_until_stopped(sandbox: LocalSandbox) -> None:
    ws = await sandbox.open(TENANT, new_run_id(), BranchId(0))
    resident = await sandbox.start_resident(ws, generation=1, identity="r-1", memory_bytes=32 << 20)
    assert resident.memory_bytes() >= 32 << 20
    assert await resident.ping() == f"pong r-1 {32 << 20}"
    await resident.stop()
    await resident.stop()  # twice is harmless
    assert resident.memory_bytes() == 0
    with pytest.raises(SandboxError):
        await resident.ping()
    await sandbox.discard(ws)


def test_suspension_needs_a_provider_with_resident_sandboxes(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="resident"):
        Suspension(object(), POLICY)
    with pytest.raises(ValueError, match="idle_after_s"):
        SuspendPolicy(idle_after_s=-1)


async def test_a_generation_whose_start_cannot_be_recorded_is_stopped(
    work_log: EventLog, sandbox: LocalSandbox
) -> None:
    """A lost lease or a broken log at `SandboxStarted`: the process it would have named
    does not outlive the failure, and no step ran in it."""

    class Refuses(LogJournal):
        async def record_and_commit(self, key: Any, *evs: Event, emits: Any = ()) -> None:
            if any(isinstance(e, SandboxStarted) for e in evs):
                raise RuntimeError("the lease was lost")
            await super().record_and_commit(key, *evs, emits=emits)

    spec = spec_for([WRITE, READ])
    with pytest.raises(RuntimeError, match="lease"):
        await driver(sandbox).drive(spec, Refuses(work_log))
    assert not residents_of(spec.ref.run_id)
    assert not any(isinstance(e, AttemptFinished) for e in await events(work_log, spec.key))


async def eventually(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait until `check()` holds; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def processes_naming(marker: str) -> list[int]:
    """Processes alive whose command line holds `marker`."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{name}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(name))
    return found


def ancestors(pid: int) -> list[int]:
    """`pid`'s parent, its parent, … up to the first process (from `/proc`)."""
    chain = []
    while pid > 1:
        with open(f"/proc/{pid}/stat", "rb") as f:
            pid = int(f.read().rsplit(b")", 1)[1].split()[1])
        chain.append(pid)
    return chain


HOLD = "import sys, time; held = b'2' * (32 << 20); time.sleep(60)  # {marker}"
"""A command that holds 32 MiB until it is killed (its command line names it)."""


async def test_a_command_runs_inside_the_resident_and_its_release_frees_both(
    sandbox: LocalSandbox,
) -> None:
    """Commands of a workspace with a resident sandbox are the resident process's children:
    their memory is the sandbox's, and stopping the sandbox (a release) ends them too."""
    ws = await sandbox.open(TENANT, new_run_id(), BranchId(0))
    resident = await sandbox.start_resident(ws, generation=1, identity="r-1", memory_bytes=16 << 20)
    alone = resident.memory_bytes()
    assert alone >= 16 << 20
    marker = uuid.uuid4().hex
    command = asyncio.ensure_future(
        ws.run(["python3", "-c", HOLD.format(marker=marker)], timeout_s=60)
    )
    await eventually(lambda: bool(processes_naming(marker)))
    (pid,) = processes_naming(marker)
    assert resident.proc.pid in ancestors(pid), "the command runs beside the resident"
    await eventually(lambda: resident.memory_bytes() >= alone + (32 << 20))
    await resident.stop()  # what a release does
    with pytest.raises(SandboxError, match="gone"):
        await command
    assert not processes_naming(marker), "a command outlived its resident sandbox"
    assert resident.memory_bytes() == 0
    assert sandbox.resident_of(ws) is None
    assert (await ws.run(["true"], timeout_s=10)).ok  # beside it again, as without one
    await sandbox.discard(ws)


async def test_a_command_inside_the_resident_keeps_its_limits(
    sandbox: LocalSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Timeout, output limit, stdin, the scrubbed environment, and nothing a command left
    behind survives it — as for a command run through the launcher alone."""
    monkeypatch.setenv("ASSAY_PROBE_SECRET", "do-not-leak")
    small = LocalSandbox(
        sandbox.base, sandbox.blobs, limits=Limits(output_bytes=1000, processes=16)
    )
    ws = await small.open(TENANT, new_run_id(), BranchId(0))
    resident = await small.start_resident(ws, generation=1, identity="r-1", memory_bytes=0)
    try:
        assert small.resident_of(ws) is resident
        slow = await ws.run(["sleep", "30"], timeout_s=0.3)
        assert slow.timed_out
        assert not slow.ok
        big = await ws.run(["head", "-c", "5000", "/dev/zero"], timeout_s=10)
        assert big.truncated
        assert len(big.stdout) == 1000
        echoed = await ws.run(["cat"], timeout_s=10, stdin=b"to the command")
        assert echoed.stdout == "to the command"
        env = await ws.run(["env"], timeout_s=10, env={"GIVEN": "yes"})
        assert "GIVEN=yes" in env.stdout
        assert "ASSAY_PROBE_SECRET" not in env.stdout
        assert f"HOME={ws.root}" in env.stdout
        marker = uuid.uuid4().hex
        left = await ws.run(
            ["sh", "-c", f"setsid python3 -c 'import time; time.sleep(60)  # {marker}' &"],
            timeout_s=10,
        )
        assert left.ok
        if small.capabilities.processes_contained:
            await eventually(lambda: not processes_naming(marker))
        cpu = await ws.run(
            ["python3", "-c", "import resource; print(resource.getrlimit(0))"], timeout_s=10
        )
        assert cpu.stdout.strip() == f"({small.limits.cpu_s}, {small.limits.cpu_s + 1})"
    finally:
        await resident.stop()
        await small.discard(ws)


# -- waits on a sub-workflow or a parallel step ------------------------------------------

CALL = {"id": "call", "kind": "subworkflow", "workflow": "child", "version": "latest"}


def with_child(spec: Any, steps: list[dict[str, Any]], output: str) -> Any:
    """`spec` with the sub-workflow `child@latest` (`steps`) resolved, as at spawn."""
    doc = {"id": "child", "steps": steps, "output": output}
    child = validate(WorkflowDef.model_validate(doc), frozenset(TOOLS))
    return dataclasses.replace(spec, children={"child@latest": child})


def fan(*branches: dict[str, Any]) -> list[dict[str, Any]]:
    """A parallel step over `branches` (joined by all), then the branches."""
    ids = [b["id"] for b in branches]
    return [{"id": "fan", "kind": "parallel", "branches": ids, "join": "all"}, *branches]


async def test_a_subworkflow_that_never_uses_the_sandbox_is_a_wait_that_releases_it(
    work_log: EventLog, sandbox: LocalSandbox
) -> None:
    spec = with_child(spec_for([WRITE, CALL, READ]), [THINK], "think")
    episode = await driver(sandbox).drive(spec, LogJournal(work_log))
    assert episode.output == "kept"
    assert sandbox_order(await events(work_log, spec.key)) == [
        "started 1",
        "write",
        "checkpointed 1",
        "released 1 subworkflow",
        "started 2",
        "read",
    ]
    assert not residents_of(spec.ref.run_id)


async def test_a_subworkflow_that_uses_the_sandbox_releases_it_at_its_own_waits(
    work_log: EventLog, sandbox: LocalSandbox
) -> None:
    """The child's model call releases the run's sandbox and its command resumes it: the
    records are the run's own (one stream holds every generation), the file survives."""
    spec = with_child(spec_for([WRITE, CALL], output="call"), [THINK, READ], "read")
    d = driver(sandbox)
    episode = await d.drive(spec, LogJournal(work_log))
    assert episode.output == "kept"
    assert sandbox_order(await events(work_log, spec.key)) == [
        "started 1",
        "write",
        "checkpointed 1",
        "released 1 model",
        "started 2",
    ]
    inner = dataclasses.replace(spec.key, stream=f"{spec.key.stream}/sub/call/0")
    assert sandbox_order(await events(work_log, inner)) == ["read"]
    assert d.suspension is not None
    assert metric(d.suspension, "assay_sandbox_resumes_total") == 1
    assert not residents_of(spec.ref.run_id)


async def test_a_parallel_step_with_no_sandbox_branch_is_a_wait_that_releases_it(
    work_log: EventLog, sandbox: LocalSandbox
) -> None:
    other = {**THINK, "id": "think2"}
    spec = spec_for([WRITE, *fan(THINK, other), READ])
    episode = await driver(sandbox).drive(spec, LogJournal(work_log))
    assert episode.output == "kept"
    order = [o for o in sandbox_order(await events(work_log, spec.key)) if o != "think2"]
    assert order == [
        "started 1",
        "write",
        "checkpointed 1",
        "released 1 parallel",
        "started 2",
        "read",
    ]


async def test_a_parallel_step_with_a_sandbox_branch_keeps_the_sandbox_up(
    work_log: EventLog, sandbox: LocalSandbox
) -> None:
    """Its branches run at once: the command may run at any moment of the model's long
    wait, so the sandbox is never released inside the group (docs/sandbox.md)."""
    spec = spec_for([WRITE, *fan(THINK, READ)], output="fan")
    d = driver(sandbox)
    episode = await d.drive(spec, LogJournal(work_log))
    assert episode.succeeded, episode.attempts
    evs = await events(work_log, spec.key)
    assert sandbox_order(evs) == ["started 1", "write", "read"]
    think = next(e for e in evs if isinstance(e, AttemptFinished) and e.step == "think")
    assert think.duration_ms >= POLICY.idle_after_s * 1000  # long enough to have released
    assert d.suspension is not None
    assert metric(d.suspension, "assay_sandbox_suspensions_total", kind="model") == 0
