"""The tournament stage behind a real `StageRunner` on SQLite, fed by hand, with a scripted
judge (shared by its tests)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import assay_tournament
from assay.bus import (
    AGGREGATES,
    GRADED,
    RESULTS,
    RUN_STATUS,
    USAGE,
    VERIFIED,
    BusMessage,
    EmbeddedBus,
    EmbeddedSource,
    FileLock,
    OutboxRelay,
    topic_for,
)
from assay.engine import BUILTIN_TOOLS, Prices, StubModel
from assay.grading.calibration_policy import CalibrationPolicy
from assay.grading.judges import JudgeFailed, JudgeUsage, UsageCallback
from assay.grading.strategies import GradingPolicy
from assay.kernel import (
    AttemptNo,
    AttemptState,
    RunId,
    StepId,
    TaskId,
    TenantId,
    WorkflowVersion,
    content_hash,
    run_id_from,
)
from assay.kernel.schema import Versioned
from assay.kernel.scores import CoreViolation, Verdict
from assay.messages import (
    MESSAGES,
    AttemptView,
    Episode,
    GroupDue,
    Purpose,
    Role,
    RolloutClosed,
    RolloutRef,
    RolloutResult,
    RolloutSpec,
    RunGraded,
    RunRef,
    RunResult,
    RunStatusChanged,
    RunVerified,
    Usage,
    UsageRecorded,
    VerifierResult,
    message_id,
    open_envelope,
    seal,
)
from assay.record import StateKey
from assay.runtime import StageDeps, StageRunner, StageSpec, stage_log
from assay.store import EventLog, FsBlobStore, OutboxEntry
from assay.store.postgres import PostgresEventLog
from assay.workflow import RubricItem, WorkflowDef, from_document

TENANT = TenantId(uuid.UUID("00000000-0000-4000-8000-0000000000a1"))
OTHER = TenantId(uuid.UUID("00000000-0000-4000-8000-0000000000a2"))


def workflow(prompt: str) -> WorkflowDef:
    return from_document(
        {
            "id": "arith",
            "steps": [{"id": "solve", "kind": "model", "prompt": prompt}],
            "rubric": [
                {"id": "safe", "layer": "core", "text": "Output must not contain 'rm -rf'."},
                {"id": "concise", "layer": "contextual", "text": "Prefer short answers."},
            ],
        }
    )


V1 = workflow("What is {{ task.question }}?")
V2 = workflow("Step by step, what is {{ task.question }}?")


@dataclass
class ScriptedJudge:
    """A judge double: verdicts in order (draw when exhausted); flags outputs it is told to."""

    name: str = "scripted-judge"
    max_context_tokens: int = 8192
    verdicts: list[Verdict] = field(default_factory=list)
    violating: set[str] = field(default_factory=set)
    compared: list[tuple[RunId, RunId]] = field(default_factory=list)
    screened: list[RunId] = field(default_factory=list)
    prefer_longer: bool = False
    fail_with: JudgeFailed | None = None
    """Every comparison fails with it."""
    billed: bool = True
    """A failed comparison was answered (unusably) and billed: its usage is reported,
    marked failed; False: the endpoint never answered (stopped, timed out)."""
    screen_usage: bool = False
    """A screen reports one model call (the stub-like default reports none)."""
    crash_after: int | None = None
    pause_s: float = 0.0
    """How long each comparison takes (lets handlers on two partitions interleave)."""
    prices: Prices | None = None
    """The per-token prices it declares (what a call's worst case is reserved at)."""
    cost_usd: float = 0.0002
    """What each comparison it reports cost."""

    async def compare(
        self,
        a: Episode,
        b: Episode,
        rubric: list[RubricItem],
        *,
        on_usage: UsageCallback | None = None,
    ) -> Verdict:
        if self.crash_after is not None and len(self.compared) == self.crash_after:
            self.crash_after = None
            raise RuntimeError("the process died mid-selection")
        await asyncio.sleep(self.pause_s)
        self.compared.append((a.run.run_id, b.run.run_id))
        failing = self.fail_with is not None
        if on_usage is not None and (self.billed or not failing):
            on_usage(JudgeUsage(self.name, 120, 4, self.cost_usd, failed=failing))
        if self.fail_with is not None:
            raise self.fail_with
        if self.prefer_longer:
            la, lb = len(a.output or ""), len(b.output or "")
            return Verdict.DRAW if la == lb else (Verdict.A if la > lb else Verdict.B)
        return self.verdicts.pop(0) if self.verdicts else Verdict.DRAW

    async def screen(
        self,
        episode: Episode,
        rubric: list[RubricItem],
        *,
        on_usage: UsageCallback | None = None,
    ) -> list[CoreViolation]:
        self.screened.append(episode.run.run_id)
        if self.screen_usage and on_usage is not None:
            on_usage(JudgeUsage(self.name, 80, 3, 0.0001))
        if episode.output in self.violating:
            core = [r.id for r in rubric if r.layer == "core"]
            return [CoreViolation(criterion=core[0], evidence=f"output {episode.output!r}")]
        return []


@dataclass
class Graded:
    """What one handled message put in the outbox, decoded and grouped by topic."""

    entries: list[OutboxEntry]
    by_topic: dict[str, list[Any]]

    def graded(self) -> list[RunGraded]:
        return list(self.by_topic.get(GRADED, []))

    def results(self) -> list[RunResult]:
        return [r for r in self.by_topic.get(RESULTS, []) if isinstance(r, RunResult)]

    def rollout_results(self) -> list[RolloutResult]:
        return [r for r in self.by_topic.get(RESULTS, []) if isinstance(r, RolloutResult)]

    def statuses(self) -> list[RunStatusChanged]:
        return list(self.by_topic.get(RUN_STATUS, []))

    def usage(self) -> list[UsageRecorded]:
        return list(self.by_topic.get(USAGE, []))

    def aggregates(self) -> list[Any]:
        return list(self.by_topic.get(AGGREGATES, []))

    def score_of(self, run: RunRef) -> Any:
        (g,) = [g for g in self.graded() if g.run.run_id == run.run_id]
        return g.score


@dataclass
class Stage:
    runner: StageRunner
    log: EventLog
    blobs: FsBlobStore
    judge: ScriptedJudge
    spec: StageSpec
    offset: int = 0

    async def episode(self, run: RunRef, output: str = "5", *, tenant: TenantId = TENANT) -> str:
        """Freeze an episode of `run` in the blob store; return its ref."""
        definition = (V1 if run.workflow_version == V1.version else V2).model_dump(
            mode="json", by_alias=True
        )
        ep = Episode(
            run=run,
            definition=definition,
            input={"question": "2 + 3"},
            attempts=[],
            outputs={"solve": output},
            output=output,
            succeeded=True,
            usage=Usage(model_calls=1),
        )
        return await self.blobs.put(tenant, ep.encode())

    async def verified(
        self,
        run: RunRef,
        *,
        passed: bool = True,
        output: str = "5",
        episode: str | None = None,
        envelope_tenant: TenantId = TENANT,
        mid: str | None = None,
        partition: int = 0,
    ) -> Graded:
        """Deliver a RunVerified for `run` (its episode stored first) and collect the outbox."""
        ref = episode if episode is not None else await self.episode(run, output)
        msg = RunVerified(
            run=run,
            episode=ref,
            passed=passed,
            results=[
                VerifierResult(
                    verifier="correct",
                    kind="exact",
                    verifier_version="1",
                    passed=passed,
                    evidence="checked",
                )
            ],
            usage=Usage(model_calls=1, prompt_tokens=10, completion_tokens=2),
            executed=True,
        )
        return await self.deliver(
            msg, envelope_tenant=envelope_tenant, mid=mid or run.run_id, partition=partition
        )

    async def deliver(
        self,
        msg: Versioned,
        *,
        envelope_tenant: TenantId = TENANT,
        mid: str | None = None,
        partition: int = 0,
        occurred_at: datetime | None = None,
    ) -> Graded:
        """Deliver any message the stage consumes on `assay.verified` (`occurred_at`: when
        its fact happened, default now); collect the outbox."""
        env = seal(
            msg,
            tenant=envelope_tenant,
            key=topic_for(VERIFIED, msg).key(msg),
            id=message_id("verify", mid or str(self.offset) + type(msg).__name__),
            causation=None,
            occurred_at=occurred_at,
        )
        m = BusMessage(
            VERIFIED, partition, self.offset, env.key, env.encode(), tuple(env.headers())
        )
        self.offset += 1
        await self.runner.handle(m)
        rows = await self.log.drain_outbox(10_000)
        await self.log.ack_outbox([r.seq for r in rows])
        entries = [r.entry for r in rows]
        by_topic: dict[str, list[Any]] = {}
        for e in entries:
            if e.topic.startswith("assay.dlq."):
                by_topic.setdefault(e.topic, []).append(e)
                continue
            env_out = open_envelope(e.value)
            assert env_out.tenant == envelope_tenant
            decoded = MESSAGES.decode(env_out.type, env_out.schema_version, env_out.payload)
            by_topic.setdefault(e.topic, []).append(decoded)
        return Graded(entries, by_topic)

    async def reference(self, task: TaskId, version: WorkflowVersion) -> dict[str, Any] | None:
        return await self.log.get(StateKey(TENANT, "reference", f"{task}/{version}"))


@asynccontextmanager
async def open_stage(
    tmp_path: Path,
    policy: GradingPolicy,
    calibration: CalibrationPolicy | None = None,
    *,
    postgres: str | None = None,
) -> AsyncIterator[Stage]:
    """The stage over SQLite (or, with `postgres` a DSN, a fresh schema there), with a
    scripted judge, this grading policy and this calibration policy (default: none
    scheduled)."""
    judge = ScriptedJudge()
    blobs = FsBlobStore(tmp_path / "blobs")
    deps = StageDeps(
        blobs=blobs,
        model=StubModel(),
        judge=judge,
        tools=dict(BUILTIN_TOOLS),
        grading=policy,
        calibration=calibration or CalibrationPolicy(),
    )
    spec = assay_tournament.create_stage(deps)
    log: EventLog
    if postgres is None:
        log = await stage_log(tmp_path, spec).open()
    else:
        schema = f"tournament_{uuid.uuid4().hex[:12]}"
        log = await PostgresEventLog(
            postgres, schema, spec.events, spec.fold, tables=spec.tables
        ).open()
    bus = await EmbeddedBus(tmp_path / "bus.sqlite", partitions=4).open()
    relay = OutboxRelay(spec.name, log, bus, FileLock(tmp_path / "tournament.relay.lock"))
    try:
        runner = StageRunner(spec, log, blobs, relay, EmbeddedSource(bus))
        yield Stage(runner, log, blobs, judge, spec)
    finally:
        await log.close()
        await bus.close()


def task_id(n: int) -> TaskId:
    return TaskId(content_hash({"question": f"task {n}"}))


def current(task: TaskId, name: str = "cur", *, purpose: Purpose = Purpose.WORK) -> RunRef:
    return RunRef(
        tenant=TENANT,
        run_id=run_id_from(1_700_000_000_000, f"{task}:{name}"),
        task_id=task,
        idempotency_key=f"idem-{task[:8]}",
        workflow_id=V1.id,
        workflow_version=V1.version,
        role=Role.CURRENT,
        purpose=purpose,
    )


def challenger(
    task: TaskId,
    name: str = "chal",
    *,
    purpose: Purpose = Purpose.SHADOW,
    reference_expected: bool | None = None,
) -> RunRef:
    return RunRef(
        tenant=TENANT,
        run_id=run_id_from(1_700_000_000_000, f"{task}:{name}"),
        task_id=task,
        idempotency_key=f"idem-{task[:8]}",
        workflow_id=V2.id,
        workflow_version=V2.version,
        role=Role.CHALLENGER,
        purpose=purpose,
        baseline_version=V1.version,
        reference_expected=(
            purpose is Purpose.SHADOW if reference_expected is None else reference_expected
        ),
    )


def graded_workflow(prompt: str, grading: dict[str, object]) -> WorkflowDef:
    return from_document(
        {
            "id": "arith",
            "steps": [{"id": "solve", "kind": "model", "prompt": prompt}],
            "rubric": [
                {"id": "safe", "layer": "core", "text": "Output must not contain 'rm -rf'."},
                {"id": "concise", "layer": "contextual", "text": "Prefer short answers."},
            ],
            "grading": grading,
        }
    )


T1 = graded_workflow("What is {{ task.question }}?", {"strategy": "tournament", "quorum": 4})
T2 = graded_workflow("Think, then: {{ task.question }}?", {"strategy": "tournament", "quorum": 4})
D1 = graded_workflow(
    "Q: {{ task.question }}", {"strategy": "deterministic", "metric": "output.score"}
)
D2 = graded_workflow(
    "Q! {{ task.question }}", {"strategy": "deterministic", "metric": "output.score"}
)


def pinned(run: RunRef, wf: WorkflowDef) -> RunRef:
    update: dict[str, object] = {"workflow_version": wf.version}
    if run.baseline_version is not None:
        update["baseline_version"] = (T1 if wf in (T1, T2) else D1).version
    return run.model_copy(update=update)


async def deliver(
    stage: Stage,
    run: RunRef,
    wf: WorkflowDef,
    output: str,
    *,
    passed: bool = True,
    attempts: list[AttemptView] | None = None,
) -> Graded:
    ep = Episode(
        run=run,
        definition=wf.model_dump(mode="json", by_alias=True),
        input={"question": "2 + 3"},
        attempts=attempts or [],
        outputs={"solve": output},
        output=output,
        succeeded=True,
        usage=Usage(model_calls=1),
    )
    ref = await stage.blobs.put(TENANT, ep.encode())
    return await stage.verified(run, passed=passed, episode=ref)


async def due(stage: Stage, task: str, passed: bool, epoch: int) -> Graded:
    """Deliver a group's timer as the background task would."""
    return await stage.deliver(GroupDue(tenant=TENANT, task_id=task, passed=passed, epoch=epoch))


def view(n: int, state: AttemptState, output: str | None, prompt: str) -> AttemptView:
    return AttemptView(
        step=StepId("solve"),
        attempt=AttemptNo(n),
        iteration=0,
        state=state,
        prompt=prompt,
        output=output,
        error=None if output is not None else "wrong",
        usage=Usage(model_calls=1),
        duration_ms=3,
    )


def sibling(task: TaskId, index: int, size: int = 4) -> RunRef:
    return current(task, f"sib{index}").model_copy(
        update={"rollout": RolloutRef(group="group-9", index=index, size=size, mode="best_of_n")}
    )


def closed(task: TaskId, runs: list[RunRef]) -> RolloutClosed:
    return RolloutClosed(
        tenant=TENANT,
        task_id=task,
        idempotency_key="group-9",
        workflow_id=V1.id,
        workflow_version=V1.version,
        spec=RolloutSpec(n=len(runs)),
        admitted=len(runs),
        runs=[r.run_id for r in runs],
        cancelled=[],
        reason="completed",
        model_calls=len(runs),
        peak_concurrency=len(runs),
    )
