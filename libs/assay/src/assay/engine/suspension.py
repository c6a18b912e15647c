"""Suspending a run's resident sandbox while the run waits (DESIGN §16, issue 17 item 11).

With a `SuspendPolicy`, a run that uses the sandbox gets a *resident sandbox*: a
long-lived process in its workspace, as an agent keeps a shell or interpreter.
The driver calls this controller at its wait boundaries:

- `ready` before a step that needs the sandbox: if no verified generation is up,
  restore the workspace from the last recorded snapshot, start generation g+1 in
  it, check that the process answers with the identity it was given and that the
  restored workspace archives to the snapshot it came from, and record
  `SandboxStarted` — only then does the step run.
- `waiting` around a model call: once the call has lasted `idle_after_s`, `release`.
- `release` (an `await` step, at once: a suspended run holds no worker): archive
  the workspace and record `SandboxCheckpointed` (durable before anything is
  released), stop the resident process and wait until it is gone, remove the
  workspace, and record `SandboxReleased` — the wait counts as idle from there.
- `close` when the drive ends, however it ends: stop what is still up.

A crash anywhere in between loses nothing: the resident process dies with its
worker (parent-death signal), the workspace's last snapshot is in the log, and
the next worker starts a new generation before any step that needs it. Crash
points: `sandbox.after_stop` (stopped, release not recorded),
`sandbox.after_restore` (workspace restored, no process yet) and
`sandbox.after_start` (process up, not verified), beside the commit boundaries
of the three records.

A sub-workflow works in its run's sandbox: its steps wait and start it as the run's
own do, and the records go to the run's own stream (`RunContext.root`), so one log
holds the sandbox's generations. A sub-workflow or a parallel step none of whose
steps needs the sandbox is one wait (`subworkflow`, `parallel`), timed as a model
call is. A parallel step with a branch that needs the sandbox never releases it:
its branches run at once, so the sandbox may be busy at any moment of the group.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram

from assay.crash import crash_point
from assay.engine.context import RunContext
from assay.engine.events import SandboxCheckpointed, SandboxReleased, SandboxStarted
from assay.kernel.errors import AssayError
from assay.kernel.ids import BranchId, RunId, TenantId
from assay.sandbox.port import ResidentSandbox, ResidentSandboxes, SuspendPolicy, Workspace

__all__ = ["ResumeRefused", "SuspendPolicy", "Suspension", "SuspensionMetrics"]

T = TypeVar("T")

RESUME_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
"""Seconds: restoring a workspace and starting a verified generation."""


class ResumeRefused(AssayError):
    """A new generation did not verify: it answered with another identity, or its
    restored workspace is not the snapshot it was restored from. No step runs in it."""


class SuspensionMetrics:
    """The controller's Prometheus metrics, in `registry` (labels: the wait kind only)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.suspensions = Counter(
            "assay_sandbox_suspensions",
            "Resident sandboxes checkpointed and released during a wait, by wait kind.",
            ["kind"],
            registry=self.registry,
        )
        self.resumes = Counter(
            "assay_sandbox_resumes",
            "New resident sandbox generations started after an earlier one was released "
            "(or its worker died), restored and verified.",
            registry=self.registry,
        )
        self.resume_seconds = Histogram(
            "assay_sandbox_resume_seconds",
            "Restoring a workspace and starting and verifying its new generation.",
            buckets=RESUME_BUCKETS,
            registry=self.registry,
        )
        self.memory_seconds = Counter(
            "assay_sandbox_resident_memory_byte_seconds",
            "Resident memory (RSS) of resident sandboxes times the time they were up.",
            registry=self.registry,
        )


_Key = tuple[TenantId, RunId, BranchId]


@dataclass
class _Held:
    """One run branch's resident sandbox as this process knows it."""

    generation: int
    """The last generation recorded for the branch."""
    checkpoint: str | None = None
    """The snapshot the last generation was checkpointed to, if it was."""
    resident: ResidentSandbox | None = None
    """The verified generation that is up, if any."""
    starting: ResidentSandbox | None = None
    """A generation started and not yet verified."""
    up_since: float = 0.0
    rss_at_start: int = 0
    watched: bool = False
    """A wait is being timed (a sub-workflow's): the waits inside it are not, again."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Suspension:
    """The suspension controller of one driver (see the module's description)."""

    def __init__(
        self,
        sandbox: object,
        policy: SuspendPolicy,
        metrics: SuspensionMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(sandbox, ResidentSandboxes):
            raise TypeError("this sandbox provider keeps no resident sandboxes")
        self.sandbox = sandbox
        self.policy = policy
        self.metrics = metrics if metrics is not None else SuspensionMetrics()
        self.clock = clock
        self._held: dict[_Key, _Held] = {}

    @staticmethod
    def _key(run: RunContext) -> _Key:
        return run.spec.ref.tenant, run.spec.ref.run_id, run.spec.branch

    @staticmethod
    def _stream(run: RunContext) -> RunContext:
        """Where the sandbox's records go: the run's own stream, a sub-workflow's too."""
        return run.root or run

    async def _state(self, run: RunContext) -> _Held:
        """This process's record of the branch's sandbox; from its log the first time."""
        held = self._held.get(self._key(run))
        if held is None:
            held = _Held(generation=0)
            stream = self._stream(run)
            for record in await stream.journal.history(stream.spec.key):
                match record.event:
                    case SandboxStarted(generation=g):
                        held.generation, held.checkpoint = max(held.generation, g), None
                    case SandboxCheckpointed(workspace=ref):
                        held.checkpoint = ref
            held = self._held.setdefault(self._key(run), held)
        return held

    async def ready(self, run: RunContext) -> None:
        """A verified generation is up, holding the run's workspace (see the module).

        Raises:
            ResumeRefused: the new generation did not verify (it is stopped again).
            SandboxError: it could not be restored or started.
        """
        held = await self._state(run)
        async with held.lock:
            if held.resident is None:
                await self._start(run, held)

    async def _start(self, run: RunContext, held: _Held) -> None:
        t0 = self.clock()
        ref, sandbox, spec = held.checkpoint or run.workspace_ref, self.sandbox, run.spec
        if run.workspace is not None:  # never reused: what a generation left is discarded
            await self.sandbox.discard(run.workspace)
            run.workspace = None
        if ref is None:
            ws = await self.sandbox.open(spec.ref.tenant, spec.ref.run_id, spec.branch)
        else:
            ws = await self.sandbox.restore(spec.ref.tenant, spec.ref.run_id, spec.branch, ref)
        crash_point("sandbox.after_restore")
        generation = held.generation + 1
        identity = f"{spec.ref.tenant}/{spec.ref.run_id}/{spec.branch}/g{generation}/"
        identity += uuid.uuid4().hex[:12]
        resident = await sandbox.start_resident(
            ws,
            generation=generation,
            identity=identity,
            memory_bytes=self.policy.resident_memory_bytes,
        )
        held.starting, up = resident, self.clock()  # up, not usable: no step runs in it
        crash_point("sandbox.after_start")
        try:
            await self._verify(resident, ws, ref)
            elapsed = self.clock() - t0
            started = SandboxStarted(
                generation=generation,
                identity=identity,
                restored_from=ref,
                start_ms=int(elapsed * 1000),
            )
            await self._stream(run).record_and_commit(started)
        except BaseException:  # unverified or unrecorded: nothing may run in it
            await resident.stop()
            await self.sandbox.discard(ws)
            raise
        finally:
            held.starting = None
        held.generation, held.checkpoint, held.resident = generation, None, resident
        held.up_since, held.rss_at_start = up, resident.memory_bytes()
        run.workspace = ws
        if generation > 1:
            self.metrics.resumes.inc()
            self.metrics.resume_seconds.observe(elapsed)

    async def _verify(self, resident: ResidentSandbox, ws: Workspace, ref: str | None) -> None:
        answer = await resident.ping()
        if not answer.startswith(f"pong {resident.identity} "):
            raise ResumeRefused(f"generation {resident.generation} answered {answer[:120]!r}")
        if ref is not None:
            restored = await self.sandbox.snapshot(ws)
            if restored != ref:
                raise ResumeRefused(f"the workspace restored from {ref} archives to {restored}")

    async def waiting(self, run: RunContext, kind: str, work: Awaitable[T]) -> T:
        """Await `work` — a model call, or a sub-workflow or parallel step none of whose
        steps needs the sandbox — and release the sandbox once it lasted `idle_after_s`.

        A call that ends while the sandbox is being released waits for the release.
        Waits inside a wait already timed (a sub-workflow's model calls) are not timed
        again: the outer one releases, with its kind.
        """
        held = self._held.get(self._key(run))
        if held is None or held.resident is None or held.watched:
            return await work
        task = asyncio.ensure_future(work)
        held.watched = True
        try:
            done, _ = await asyncio.wait({task}, timeout=self.policy.idle_after_s)
            if not done:
                await self.release(run, kind)
            return await task
        finally:
            held.watched = False
            if not task.done():
                task.cancel()

    async def release(self, run: RunContext, kind: str) -> None:
        """Checkpoint durably, stop, confirm, record the release (nothing if none is up)."""
        held = self._held.get(self._key(run))
        if held is None:
            return
        async with held.lock:
            resident = held.resident
            if resident is None or run.workspace is None:
                return
            ref = await self.sandbox.snapshot(run.workspace)
            checkpoint = SandboxCheckpointed(generation=resident.generation, workspace=ref)
            await self._stream(run).record_and_commit(checkpoint)
            held.checkpoint = run.workspace_ref = ref
            await self._stop(held, resident)
            crash_point("sandbox.after_stop")
            await self.sandbox.discard(run.workspace)
            run.workspace = None
            released = SandboxReleased(generation=resident.generation, wait=kind)
            await self._stream(run).record_and_commit(released)
            self.metrics.suspensions.labels(kind).inc()

    async def close(self, run: RunContext) -> None:
        """The drive ended: stop the branch's resident sandbox, recording nothing."""
        held = self._held.pop(self._key(run), None)
        if held is not None and held.resident is not None:
            await self._stop(held, held.resident)

    async def _stop(self, held: _Held, resident: ResidentSandbox) -> None:
        rss = (held.rss_at_start + resident.memory_bytes()) / 2
        await resident.stop()
        held.resident = None
        self.metrics.memory_seconds.inc(rss * max(0.0, self.clock() - held.up_since))

    def live(self) -> list[ResidentSandbox]:
        """Every resident sandbox process up in this process now (verified or not yet)."""
        held = self._held.values()
        return [r for h in held for r in (h.resident, h.starting) if r is not None]

    def resident(self, run: RunContext) -> ResidentSandbox | None:
        """The run's resident sandbox up in this process, if any."""
        held = self._held.get(self._key(run))
        return None if held is None else held.resident
