"""Model vs reality: resident sandboxes suspended for real, against the simulator's
prediction on the same runs (issue 17 item 12, DESIGN §16).

One workload, run twice with the same driver, sandbox and log: `RUNS` runs at once of a
workflow that writes a file in its sandbox, waits on the stub model (`MODEL_DELAY_S` a
call), reads the file, waits on the model again and reads again. First with resident
sandboxes always on (a policy whose `idle_after` is never reached), then suspended after
`IDLE_AFTER_S`. Measured both ways: resident sandbox memory-seconds, by sampling the RSS
of every live resident process tree from `/proc` every `SAMPLE_S`, and completion time,
each run's drive from start to end. The always-on runs are then exported as traces with
`assay fleet export`'s code — the sandbox declared at the resident's measured mean RSS —
and simulated under the same policy, charged the checkpoint and resume costs the
suspended runs' logs show. Reported: `fleet.saving_predicted`, `fleet.saving_measured`,
their ratio, and the same for the completion-time overhead.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from assay.engine import Driver, LogJournal, RunFinished, RunSpec, StubModel
from assay.engine.events import (
    WORK_EVENTS,
    AttemptStarted,
    SandboxReleased,
    SandboxStarted,
    fold_work,
)
from assay.engine.sandbox_tools import sandbox_tools
from assay.engine.suspension import SuspendPolicy, Suspension
from assay.engine.tools import BUILTIN_TOOLS
from assay.fleet.export import Resources, trace_of_run
from assay.fleet.simulate import Policy, simulate
from assay.fleet.trace import Trace
from assay.kernel import BranchId, TaskId, content_hash, new_run_id, tenant_id
from assay.messages import Purpose, Role, RunRef
from assay.record import LogRecord
from assay.sandbox import LocalSandbox
from assay.store import FsBlobStore, SqliteEventLog
from assay.workflow import WorkflowDef, validate

RUNS = 4
MODEL_DELAY_S = 2.0
IDLE_AFTER_S = 0.5
NEVER_S = 1e9
"""The always-on baseline's `idle_after`: no call lasts that long."""
RESIDENT_BYTES = 64 << 20
SAMPLE_S = 0.05
TENANT = tenant_id(uuid.UUID("5e1f0c3a-2b4d-4e6f-8a9b-0c1d2e3f4a5b"))
TOOLS = {**BUILTIN_TOOLS, **sandbox_tools()}
WORKFLOW: dict[str, Any] = {
    "id": "fleet-bench",
    "steps": [
        {
            "id": "write",
            "kind": "tool",
            "tool": "write_file",
            "args": {"path": "note.txt", "content": "{{ task.item }}"},
        },
        {"id": "plan", "kind": "model", "prompt": "What is 2 + 3? Answer with only the number."},
        {"id": "look", "kind": "tool", "tool": "command", "args": {"argv": '["cat", "note.txt"]'}},
        {"id": "check", "kind": "model", "prompt": "What is 4 + 4? Answer with only the number."},
        {"id": "read", "kind": "tool", "tool": "command", "args": {"argv": '["cat", "note.txt"]'}},
    ],
    "output": "read",
}


@dataclass
class Measured:
    """One mode's runs: what the sampler and the clock saw, and what the log holds."""

    memory_byte_s: float
    resident_s: float
    """Resident sandbox lifetimes, summed over the samples."""
    completion_s: list[float]
    records: list[list[LogRecord]]


def _spec(i: int) -> RunSpec:
    wf = validate(WorkflowDef.model_validate(WORKFLOW), frozenset(TOOLS))
    run_id, task = new_run_id(), {"item": f"item-{i}"}
    ref = RunRef(
        tenant=TENANT,
        run_id=run_id,
        task_id=TaskId(content_hash(task)),
        idempotency_key=f"fleet-bench-{run_id}",
        workflow_id=wf.id,
        workflow_version=wf.version,
        role=Role.CURRENT,
        purpose=Purpose.WORK,
    )
    return RunSpec(ref=ref, definition=wf, input=task, branch=BranchId(0))


async def _sample(suspension: Suspension, into: list[float], stop: asyncio.Event) -> None:
    """Integrate the RSS of every live resident sandbox (byte-seconds, resident-seconds)."""
    last = time.monotonic()
    while not stop.is_set():
        residents = suspension.live()
        rss = sum(r.memory_bytes() for r in residents)
        now = time.monotonic()
        into[0] += rss * (now - last)
        into[1] += len(residents) * (now - last)
        last = now
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), SAMPLE_S)


async def _mode(tmp: Path, idle_after_s: float) -> Measured:
    blobs = FsBlobStore(tmp / "blobs")
    sandbox = LocalSandbox(tmp / "sandbox", blobs)
    log = await SqliteEventLog(tmp / "execute.sqlite", WORK_EVENTS, fold_work).open()
    suspension = Suspension(sandbox, SuspendPolicy(idle_after_s, RESIDENT_BYTES))
    driver = Driver(StubModel(delay_s=MODEL_DELAY_S), TOOLS, sandbox, suspension=suspension)
    journal = LogJournal(log)
    specs = [_spec(i) for i in range(RUNS)]

    async def one(spec: RunSpec) -> float:
        t0 = time.monotonic()
        episode = await driver.drive(spec, journal)
        if not episode.succeeded or episode.output != spec.input["item"]:
            raise RuntimeError(f"a benchmark run failed: {episode.attempts}")
        ref = await blobs.put(TENANT, episode.encode())
        done = RunFinished(succeeded=True, episode=ref, usage=episode.usage)
        await journal.record_and_commit(spec.key, done)
        return time.monotonic() - t0

    acc, stop = [0.0, 0.0], asyncio.Event()
    sampler = asyncio.create_task(_sample(suspension, acc, stop))
    try:
        completion = await asyncio.gather(*(one(s) for s in specs))
    finally:
        stop.set()
        await sampler
    records = [await log.read(s.key) for s in specs]
    await log.close()
    return Measured(acc[0], acc[1], list(completion), records)


def _costs(runs: Sequence[Sequence[LogRecord]], idle_after_ms: int) -> tuple[float, float, int]:
    """Mean checkpoint cost (release recorded minus the wait's start and idle_after) and
    mean resume cost (`SandboxStarted.start_ms` of generations after the first), in
    seconds, and how many suspensions there were, from the suspended runs' logs."""
    checkpoint, resume = [], []
    for recs in runs:
        waited_since = 0
        for r in recs:
            match r.event:
                case AttemptStarted(step=step) if step in ("plan", "check"):
                    waited_since = r.at_ms
                case SandboxReleased():
                    checkpoint.append(r.at_ms - waited_since - idle_after_ms)
                case SandboxStarted(generation=g, start_ms=ms) if g > 1:
                    resume.append(ms)
    mean = statistics.fmean
    return mean(checkpoint) / 1000, mean(resume) / 1000, len(checkpoint)


def _traces(runs: Sequence[Sequence[LogRecord]], memory_gib: float) -> list[Trace]:
    traces = [trace_of_run(recs, Resources(cpu_cores=1.0, memory_gib=memory_gib)) for recs in runs]
    if any(t is None for t in traces):
        raise RuntimeError("a benchmark run did not export")
    return [t for t in traces if t is not None]


async def _both(tmp: Path) -> tuple[Measured, Measured]:
    always = await _mode(tmp / "always-on", NEVER_S)
    suspended = await _mode(tmp / "suspended", IDLE_AFTER_S)
    return always, suspended


def fleet_figures(tmp: Path) -> dict[str, float]:
    """The model-vs-reality figures (see the module's description)."""
    started = time.monotonic()
    always, suspended = asyncio.run(_both(tmp))
    checkpoint_s, resume_s, suspensions = _costs(suspended.records, int(IDLE_AFTER_S * 1000))
    mean_rss_gib = always.memory_byte_s / always.resident_s / 2**30
    policy = Policy.from_seconds(IDLE_AFTER_S, max(0.0, checkpoint_s), resume_s)
    traces = _traces(always.records, mean_rss_gib)
    predicted = simulate(traces, policy)
    run_s = sum(t.events[-1].t_ms for t in traces) / 1000
    held_s = sum(o.held_ms for o in predicted.outcomes) / 1000
    measured_saving = 1 - suspended.memory_byte_s / always.memory_byte_s
    base, susp = sum(always.completion_s), sum(suspended.completion_s)
    measured_overhead = susp / base - 1
    gib_s = 2**30
    return {
        "fleet.runs": RUNS,
        "fleet.model_delay_s": MODEL_DELAY_S,
        "fleet.idle_after_s": IDLE_AFTER_S,
        "fleet.resident_mean_rss_mb": round(mean_rss_gib * 1024, 1),
        # Sandbox-seconds held, summed over the runs: measured (a resident process up,
        # from the samples) beside what the simulator charges (the whole run always on;
        # suspended, the run less what it releases plus what resumes add). A resident
        # sandbox starts at the first step that needs it, not with the run.
        "fleet.always_on.held_s": round(always.resident_s, 2),
        "fleet.always_on.held_s_predicted": round(run_s, 2),
        "fleet.suspended.held_s": round(suspended.resident_s, 2),
        "fleet.suspended.held_s_predicted": round(held_s, 2),
        "fleet.checkpoint_ms": round(checkpoint_s * 1000, 1),
        "fleet.resume_ms": round(resume_s * 1000, 1),
        "fleet.suspensions": suspensions,
        "fleet.suspensions_predicted": predicted.suspensions,
        "fleet.always_on.memory_gib_s": round(always.memory_byte_s / gib_s, 3),
        "fleet.suspended.memory_gib_s": round(suspended.memory_byte_s / gib_s, 3),
        "fleet.always_on.completion_s": round(base, 2),
        "fleet.suspended.completion_s": round(susp, 2),
        "fleet.saving_predicted": round(predicted.memory_saving, 4),
        "fleet.saving_measured": round(measured_saving, 4),
        "fleet.saving_ratio": round(measured_saving / predicted.memory_saving, 3),
        "fleet.overhead_predicted": round(predicted.overhead, 4),
        "fleet.overhead_measured": round(measured_overhead, 4),
        "fleet.overhead_ratio": round(measured_overhead / predicted.overhead, 3)
        if predicted.overhead
        else 0.0,
        "fleet.wall_s": round(time.monotonic() - started, 1),
    }
