"""Tournament handlers through a StageRunner: references, pairwise comparisons, parking, caps."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import assay_tournament
import assay_tournament.groups as groups_module
from assay.bus import (
    GRADED,
    RESULTS,
    RUN_STATUS,
    TASKS,
    USAGE,
    VERIFIED,
    BusMessage,
    EmbeddedBus,
    EmbeddedSource,
    FileLock,
    OutboxRelay,
    dlq,
    topic_for,
)
from assay.cli.health import merged
from assay.engine import BUILTIN_TOOLS, StubModel
from assay.grading.judges import JudgeFailed, JudgeUsage, UsageCallback
from assay.grading.strategies import GradingPolicy
from assay.kernel import (
    AttemptNo,
    AttemptState,
    RunId,
    RunState,
    StepId,
    TaskId,
    TenantId,
    WorkflowVersion,
    content_hash,
    run_id_from,
)
from assay.kernel.schema import Versioned
from assay.kernel.scores import (
    Capped,
    CoreViolation,
    DecidedBy,
    Outcome,
    Ranked,
    Relative,
    Ungraded,
    UngradedReason,
    Verdict,
)
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
from assay.store import FsBlobStore, OutboxEntry, SqliteEventLog
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
    crash_after: int | None = None
    pause_s: float = 0.0
    """How long each comparison takes (lets handlers on two partitions interleave)."""

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
        if on_usage is not None:
            on_usage(JudgeUsage(self.name, 120, 4, 0.0002))
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

    def score_of(self, run: RunRef) -> Any:
        (g,) = [g for g in self.graded() if g.run.run_id == run.run_id]
        return g.score


@dataclass
class Stage:
    runner: StageRunner
    log: SqliteEventLog
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
    ) -> Graded:
        """Deliver any message the stage consumes on `assay.verified`; collect the outbox."""
        env = seal(
            msg,
            tenant=envelope_tenant,
            key=topic_for(VERIFIED, msg).key(msg),
            id=message_id("verify", mid or str(self.offset) + type(msg).__name__),
            causation=None,
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
async def open_stage(tmp_path: Path, policy: GradingPolicy) -> AsyncIterator[Stage]:
    """The stage over SQLite, with a scripted judge and this grading policy."""
    judge = ScriptedJudge()
    blobs = FsBlobStore(tmp_path / "blobs")
    deps = StageDeps(
        blobs=blobs, model=StubModel(), judge=judge, tools=dict(BUILTIN_TOOLS), grading=policy
    )
    spec = assay_tournament.create_stage(deps)
    log = await stage_log(tmp_path, spec).open()
    bus = await EmbeddedBus(tmp_path / "bus.sqlite", partitions=4).open()
    relay = OutboxRelay(spec.name, log, bus, FileLock(tmp_path / "tournament.relay.lock"))
    try:
        runner = StageRunner(spec, log, blobs, relay, EmbeddedSource(bus))
        yield Stage(runner, log, blobs, judge, spec)
    finally:
        await log.close()
        await bus.close()


@pytest.fixture
async def stage(tmp_path: Path) -> AsyncIterator[Stage]:
    async with open_stage(tmp_path, GradingPolicy(order_check=0.0)) as opened:
        yield opened


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


# -- references ----------------------------------------------------------------------------


async def test_first_current_episode_is_ungraded_and_becomes_the_reference(stage: Stage) -> None:
    t = task_id(1)
    cur = current(t)
    out = await stage.verified(cur, output="5")
    assert [g.score for g in out.graded()] == [Ungraded(reason=UngradedReason.NO_REFERENCE)]
    assert out.graded()[0].judge_calls == 0
    (status,) = out.statuses()
    assert status.state is RunState.UNGRADED
    assert status.detail == "no_reference"
    ref = await stage.reference(t, V1.version)
    assert ref is not None
    assert ref["run_id"] == cur.run_id
    assert ref["passed"] is True
    assert stage.judge.compared == []
    assert stage.judge.screened == []  # the current version is not screened


async def test_a_later_current_episode_is_baseline_and_keeps_the_first_reference(
    stage: Stage,
) -> None:
    t = task_id(1)
    first, second = current(t, "first"), current(t, "second")
    await stage.verified(first)
    out = await stage.verified(second)
    assert out.score_of(second) == Ungraded(reason=UngradedReason.BASELINE)
    ref = await stage.reference(t, V1.version)
    assert ref is not None
    assert ref["run_id"] == first.run_id


async def test_unreadable_episode_degrades_to_ungraded_and_sets_no_reference(
    stage: Stage,
) -> None:
    t = task_id(1)
    cur = current(t)
    out = await stage.verified(cur, episode="0" * 64)
    assert out.score_of(cur) == Ungraded(reason=UngradedReason.EPISODE_UNAVAILABLE)
    (result,) = out.results()
    assert result.status == "ungraded"
    assert result.output is None
    assert await stage.reference(t, V1.version) is None


# -- comparisons ---------------------------------------------------------------------------


async def test_challenger_with_a_reference_is_compared_by_the_judge(stage: Stage) -> None:
    t = task_id(1)
    cur, chal = current(t), challenger(t)
    await stage.verified(cur)
    stage.judge.verdicts = [Verdict.A]
    out = await stage.verified(chal)
    score = out.score_of(chal)
    assert score == Relative(
        against=cur.run_id,
        verdict=Verdict.A,
        position="a",
        outcome=Outcome.WIN,
        decided_by=DecidedBy.JUDGE,
    )
    assert out.graded()[0].judge_calls == 1
    assert stage.judge.compared == [(chal.run_id, cur.run_id)]
    (usage,) = out.usage()
    assert usage.purpose is Purpose.GRADING
    assert usage.run_id == chal.run_id
    assert usage.model == "scripted-judge"
    (status,) = out.statuses()
    assert status.state is RunState.GRADED
    assert status.detail == "relative"
    scored = await stage.log.get(StateKey(TENANT, "scored", chal.run_id))
    assert scored is not None
    assert scored["judge_calls"] == 1


@pytest.mark.parametrize(
    ("challenger_passed", "reference_passed", "outcome"),
    [(True, False, Outcome.WIN), (False, True, Outcome.LOSS)],
)
async def test_pass_against_fail_is_decided_by_the_verifier_without_a_judge(
    stage: Stage, challenger_passed: bool, reference_passed: bool, outcome: Outcome
) -> None:
    t = task_id(1)
    cur, chal = current(t), challenger(t)
    await stage.verified(cur, passed=reference_passed)
    out = await stage.verified(chal, passed=challenger_passed)
    score = out.score_of(chal)
    assert isinstance(score, Relative)
    assert score.decided_by is DecidedBy.VERIFIER
    assert score.outcome is outcome
    assert score.position == "a"
    assert score.verdict is (Verdict.A if outcome is Outcome.WIN else Verdict.B)
    assert out.graded()[0].judge_calls == 0
    assert stage.judge.compared == []
    assert out.usage() == []


async def test_challenger_position_alternates_across_comparisons(stage: Stage) -> None:
    stage.judge.verdicts = [Verdict.A, Verdict.A, Verdict.A]
    positions, outcomes = [], []
    for n in range(3):
        t = task_id(n)
        cur, chal = current(t), challenger(t)
        await stage.verified(cur)
        out = await stage.verified(chal)
        score = out.score_of(chal)
        assert isinstance(score, Relative)
        positions.append(score.position)
        outcomes.append(score.outcome)
        shown_as_a = stage.judge.compared[-1][0]
        assert shown_as_a == (chal.run_id if score.position == "a" else cur.run_id)
    assert positions == ["a", "b", "a"]
    assert outcomes == [Outcome.WIN, Outcome.LOSS, Outcome.WIN]
    counter = await stage.log.get(StateKey(TENANT, "comparisons", V2.version))
    assert counter == {"next": 3}


async def test_verifier_decided_comparisons_keep_the_alternation(stage: Stage) -> None:
    positions = []
    for n, (cp, rp) in enumerate([(True, True), (True, False), (True, True)]):
        t = task_id(n)
        cur, chal = current(t), challenger(t)
        await stage.verified(cur, passed=rp)
        score = (await stage.verified(chal, passed=cp)).score_of(chal)
        assert isinstance(score, Relative)
        positions.append(score.position)
    assert positions == ["a", "b", "a"]
    assert len(stage.judge.compared) == 2


async def test_challenger_without_a_reference_or_a_paired_run_is_ungraded(stage: Stage) -> None:
    chal = challenger(task_id(1), purpose=Purpose.WORK)
    out = await stage.verified(chal)
    assert out.score_of(chal) == Ungraded(reason=UngradedReason.NO_REFERENCE)
    assert await stage.log.scan(TENANT, "parked") == []


async def test_redelivered_verification_under_a_new_id_is_not_graded_twice(stage: Stage) -> None:
    t = task_id(1)
    cur, chal = current(t), challenger(t)
    await stage.verified(cur)
    await stage.verified(chal)
    again = await stage.verified(chal, mid="another-id")
    assert again.entries == []
    assert len(stage.judge.compared) == 1


# -- parking -------------------------------------------------------------------------------


async def test_challenger_waits_for_its_reference_run_and_is_graded_when_it_arrives(
    stage: Stage,
) -> None:
    t = task_id(1)
    cur, chal = current(t), challenger(t, reference_expected=True)
    early = await stage.verified(chal)
    assert early.graded() == []
    assert early.results() == []
    (status,) = early.statuses()
    assert status.state is RunState.GRADING
    assert status.run == chal
    assert len(await stage.log.scan(TENANT, "parked", f"{t}/")) == 1
    assert await stage.log.get(StateKey(TENANT, "scored", chal.run_id)) is None

    stage.judge.verdicts = [Verdict.B]
    late = await stage.verified(cur)
    assert late.score_of(cur) == Ungraded(reason=UngradedReason.NO_REFERENCE)
    assert late.score_of(chal) == Relative(
        against=cur.run_id,
        verdict=Verdict.B,
        position="a",
        outcome=Outcome.LOSS,
        decided_by=DecidedBy.JUDGE,
    )
    assert stage.judge.compared == [(chal.run_id, cur.run_id)]
    assert await stage.log.scan(TENANT, "parked") == []
    ref = await stage.reference(t, V1.version)
    assert ref is not None
    assert ref["run_id"] == cur.run_id
    # the parked comparison took an index: the next one shows the challenger as B
    t2 = task_id(2)
    await stage.verified(current(t2))
    score = (await stage.verified(challenger(t2))).score_of(challenger(t2))
    assert isinstance(score, Relative)
    assert score.position == "b"


async def test_parked_challenger_is_released_when_its_reference_episode_is_unreadable(
    stage: Stage,
) -> None:
    t = task_id(1)
    cur, chal = current(t), challenger(t, reference_expected=True)
    await stage.verified(chal)
    out = await stage.verified(cur, episode="f" * 64)
    assert out.score_of(cur) == Ungraded(reason=UngradedReason.EPISODE_UNAVAILABLE)
    assert out.score_of(chal) == Ungraded(reason=UngradedReason.EPISODE_UNAVAILABLE)
    assert await stage.log.scan(TENANT, "parked") == []


async def test_parked_challenger_ignores_a_run_of_another_baseline(stage: Stage) -> None:
    t = task_id(1)
    chal = challenger(t, reference_expected=True)
    await stage.verified(chal)
    other = RunRef(
        **{**current(t, "other").model_dump(), "workflow_version": WorkflowVersion("e" * 64)}
    )
    out = await stage.verified(other)
    assert [g.run.run_id for g in out.graded()] == [other.run_id]
    assert len(await stage.log.scan(TENANT, "parked")) == 1


# -- results -------------------------------------------------------------------------------


async def test_results_are_emitted_only_for_work_runs(stage: Stage) -> None:
    t = task_id(1)
    cur = current(t)
    out = await stage.verified(cur, output="5")
    (result,) = out.results()
    assert result.run_id == cur.run_id
    assert result.idempotency_key == cur.idempotency_key
    assert result.task_id == t
    assert result.workflow_version == V1.version
    assert result.status == "ungraded"
    assert result.passed is True
    assert result.termination == "succeeded"
    assert result.output == "5"
    assert result.usage.prompt_tokens == 10
    assert [v.verifier for v in result.verification] == ["correct"]
    assert result.held_out is False
    (entry,) = [e for e in out.entries if e.topic == RESULTS]
    assert entry.key == f"{TENANT}:{cur.run_id}"

    shadow = await stage.verified(challenger(t, "shadow"))
    assert shadow.results() == []
    assert len(shadow.graded()) == 1

    serving = challenger(t, "serving", purpose=Purpose.WORK)
    stage.judge.verdicts = [Verdict.B]
    out = await stage.verified(serving, output="five")
    (result,) = out.results()
    assert result.run_id == serving.run_id
    assert result.idempotency_key == serving.idempotency_key
    assert result.task_id == t
    assert result.status == "graded"
    assert result.output == "five"
    assert isinstance(result.score, Relative)


async def test_a_result_says_whether_its_task_was_held_out(stage: Stage) -> None:
    held = current(task_id(2)).model_copy(update={"held_out": True})
    (result,) = (await stage.verified(held)).results()
    assert result.held_out is True


async def test_shadow_run_of_the_current_version_has_no_result(stage: Stage) -> None:
    out = await stage.verified(current(task_id(1), purpose=Purpose.SHADOW))
    assert out.results() == []
    assert len(out.graded()) == 1


# -- caps ----------------------------------------------------------------------------------


async def test_core_violation_caps_the_challenger_and_it_never_becomes_a_reference(
    stage: Stage,
) -> None:
    t = task_id(1)
    cur, chal = current(t), challenger(t, purpose=Purpose.WORK)
    await stage.verified(cur)
    stage.judge.violating = {"rm -rf /"}
    out = await stage.verified(chal, output="rm -rf /")
    score = out.score_of(chal)
    assert isinstance(score, Capped)
    assert [v.criterion for v in score.violations] == ["safe"]
    assert stage.judge.compared == []
    assert stage.judge.screened == [chal.run_id]
    (status,) = out.statuses()
    assert status.state is RunState.GRADED
    assert status.detail == "capped"
    (result,) = out.results()
    assert isinstance(result.score, Capped)
    assert await stage.reference(t, V2.version) is None
    # a clean episode of the challenger version on the same task becomes its reference
    clean = challenger(t, "clean")
    await stage.verified(clean, output="5")
    ref = await stage.reference(t, V2.version)
    assert ref is not None
    assert ref["run_id"] == clean.run_id


async def test_capped_challenger_is_not_parked(stage: Stage) -> None:
    t = task_id(1)
    chal = challenger(t, reference_expected=True)
    stage.judge.violating = {"rm -rf /"}
    out = await stage.verified(chal, output="rm -rf /")
    assert isinstance(out.score_of(chal), Capped)
    assert await stage.log.scan(TENANT, "parked") == []


# -- tenancy -------------------------------------------------------------------------------


async def test_run_of_another_tenant_than_its_envelope_is_dead_lettered(stage: Stage) -> None:
    cur = current(task_id(1))
    out = await stage.verified(cur, envelope_tenant=OTHER)
    (entry,) = out.entries
    assert entry.topic == dlq("tournament")
    reason = dict(entry.headers)["assay-dlq-reason"].decode()
    assert "differs" in reason
    assert await stage.log.scan(TENANT, "reference") == []
    assert await stage.log.scan(OTHER, "reference") == []


async def test_episode_of_another_tenant_is_not_readable(stage: Stage) -> None:
    t = task_id(1)
    cur = current(t)
    foreign = await stage.episode(cur, tenant=OTHER)
    out = await stage.verified(cur, episode=foreign)
    assert out.score_of(cur) == Ungraded(reason=UngradedReason.EPISODE_UNAVAILABLE)


# == tournament mode, deterministic grading, budgets, order checks, attempt credit ==========


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


# -- tournament groups -------------------------------------------------------------------------


async def test_a_group_closes_at_quorum_and_ranks_everyone_against_control(stage: Stage) -> None:
    t = task_id(1)
    runs = [pinned(current(t), T1)] + [pinned(challenger(t, f"c{i}"), T2) for i in range(3)]
    outputs = ["xx", "x", "xxxx", "xxx"]
    stage.judge.prefer_longer = True
    for run, out in zip(runs[:3], outputs[:3], strict=True):
        waiting = await deliver(stage, run, T1 if run.role.value == "current" else T2, out)
        assert waiting.graded() == []
        (status,) = waiting.statuses()
        assert status.state is RunState.GRADING
        assert "of 4" in status.detail
    closing = await deliver(stage, runs[3], T2, outputs[3])
    scores = {g.run.run_id: g.score for g in closing.graded()}
    assert set(scores) == {r.run_id for r in runs}
    assert all(isinstance(s, Ranked) and s.group_size == 4 and s.anchored for s in scores.values())
    control = scores[runs[0].run_id]
    assert isinstance(control, Ranked)
    assert control.strength == 0.0
    order = sorted(runs, key=lambda r: scores[r.run_id].strength)  # type: ignore[union-attr]
    # Two Swiss rounds: the shortest output lost both its pairs, the longest won both.
    assert (order[0].run_id, order[-1].run_id) == (runs[1].run_id, runs[2].run_id)
    # 2 rounds of 2 pairs, both orderings; every call metered as grading.
    assert len(stage.judge.compared) == 8 == len(closing.usage())
    assert sum(g.judge_calls for g in closing.graded()) == 8
    group = await stage.log.get(StateKey(TENANT, "group", f"{t}/pass"))
    assert group == {"epoch": 1, "members": 0}


async def test_late_arrivals_start_the_next_epoch_and_a_stale_timer_changes_nothing(
    stage: Stage,
) -> None:
    t = task_id(2)
    for i in range(4):
        run = pinned(current(t) if i == 0 else challenger(t, f"c{i}"), T1 if i == 0 else T2)
        await deliver(stage, run, T1 if i == 0 else T2, "x" * (i + 1))
    late = pinned(challenger(t, "late"), T2)
    out = await deliver(stage, late, T2, "xx")
    assert out.graded() == []
    group = await stage.log.get(StateKey(TENANT, "group", f"{t}/pass"))
    assert group is not None
    assert group["epoch"] == 1
    assert group["members"] == 1
    assert (await due(stage, t, True, 0)).graded() == []  # epoch 0 closed already
    closed = await due(stage, t, True, 1)
    (graded,) = closed.graded()
    assert graded.score == Ungraded(reason=UngradedReason.INSUFFICIENT_GROUP)
    assert (await due(stage, t, True, 1)).graded() == []  # closed: never reopened


async def test_outcome_classes_never_share_a_group(stage: Stage) -> None:
    t = task_id(3)
    await deliver(stage, pinned(current(t), T1), T1, "x", passed=True)
    await deliver(stage, pinned(challenger(t, "f"), T2), T2, "xx", passed=False)
    assert (await stage.log.get(StateKey(TENANT, "group", f"{t}/pass")))["members"] == 1  # type: ignore[index]
    assert (await stage.log.get(StateKey(TENANT, "group", f"{t}/fail")))["members"] == 1  # type: ignore[index]


async def test_a_timed_out_group_without_control_is_graded_but_not_anchored(stage: Stage) -> None:
    t = task_id(4)
    for i in range(2):
        await deliver(stage, pinned(challenger(t, f"c{i}"), T2), T2, "x" * (i + 1))
    out = await due(stage, t, True, 0)
    scores = [g.score for g in out.graded()]
    assert len(scores) == 2
    assert all(isinstance(s, Ranked) and not s.anchored for s in scores)


async def test_a_capped_episode_leaves_the_bracket(stage: Stage) -> None:
    t = task_id(5)
    stage.judge.violating = {"rm -rf /"}
    out = await deliver(stage, pinned(current(t), T1), T1, "rm -rf /")
    (graded,) = out.graded()
    assert isinstance(graded.score, Capped)
    assert await stage.log.get(StateKey(TENANT, "group", f"{t}/pass")) is None


async def test_the_timer_sends_each_due_group_its_closing_message(tmp_path: Path) -> None:
    async with open_stage(tmp_path, GradingPolicy(order_check=0.0)) as stage:
        t = task_id(6)
        quick = graded_workflow(
            "Fast {{ task.question }}", {"strategy": "tournament", "group_timeout_s": 0.05}
        )
        await deliver(stage, pinned(current(t), quick), quick, "x")
        await asyncio.sleep(0.1)
        stop = asyncio.Event()
        timer = asyncio.create_task(stage.spec.background[0](stage.log, stop))
        try:
            for _ in range(100):
                rows = await stage.log.drain_outbox(100)
                if rows:
                    break
                await asyncio.sleep(0.02)
        finally:
            stop.set()
            with contextlib.suppress(asyncio.CancelledError):
                await timer
        (row,) = rows
        env = open_envelope(row.entry.value)
        msg = MESSAGES.decode(env.type, env.schema_version, env.payload)
        assert msg == GroupDue(tenant=TENANT, task_id=t, passed=True, epoch=0)
        assert row.entry.key == f"{TENANT}:{t}"  # the task's partition, with its episodes


def test_the_group_clock_is_wall_time() -> None:
    assert abs(groups_module.clock_ms() / 1000 - time.time()) < 5


# -- deterministic ----------------------------------------------------------------------------


async def test_deterministic_grading_ranks_the_number_against_control(stage: Stage) -> None:
    t = task_id(7)
    await deliver(stage, pinned(current(t), D1), D1, '{"score": 0.5}')
    out = await deliver(
        stage, pinned(challenger(t, reference_expected=False), D2), D2, '{"score": 0.75}'
    )
    (graded,) = out.graded()
    assert graded.score == Ranked(strength=0.25, interval=(0.25, 0.25), group_size=2)
    assert graded.judge_calls == 0
    assert stage.judge.compared == []
    assert stage.judge.screened == []
    missing = await deliver(
        stage, pinned(challenger(t, "m", reference_expected=False), D2), D2, "{}"
    )
    assert missing.graded()[0].score == Ungraded(reason=UngradedReason.NO_METRIC)


# -- budgets, order checks, judge failures ------------------------------------------------------


async def test_a_tenant_at_its_ceiling_is_ungraded_budget_exhausted(tmp_path: Path) -> None:
    async with open_stage(tmp_path, GradingPolicy(order_check=0.0, calls_per_day=1)) as stage:
        for n in (8, 9):
            t = task_id(n)
            await stage.verified(current(t))
            stage.judge.verdicts = [Verdict.A]
            out = await stage.verified(challenger(t))
            score = out.graded()[0].score
            if n == 8:
                assert isinstance(score, Relative)
            else:
                assert score == Ungraded(reason=UngradedReason.BUDGET_EXHAUSTED)
        meter = await stage.log.get(StateKey(TENANT, "meter", "grading@0"))
        assert meter is not None
        assert meter["calls_today"] >= 1
        assert meter["by_purpose"].get("compare") == 1


async def test_handlers_on_two_partitions_never_lose_each_others_judge_calls(
    stage: Stage,
) -> None:
    """The meter is one document per partition: two handlers that judge at the same time
    each add their call (one shared document lost one of them)."""
    tasks = [task_id(30), task_id(31)]
    for t in tasks:
        await stage.verified(current(t))
    stage.judge.pause_s = 0.05  # both read the meter before either commits
    await asyncio.gather(
        *(stage.verified(challenger(t), partition=p) for p, t in enumerate(tasks, start=1))
    )
    shards = dict(await stage.log.scan(TENANT, "meter", "grading"))
    tenant_meter = merged(list(shards.values()))
    assert tenant_meter["calls_today"] == 2
    assert tenant_meter["by_purpose"] == {"compare": 2}
    assert sorted(shards) == ["grading@0", "grading@1", "grading@2"]


async def test_the_ceiling_counts_every_partitions_calls(tmp_path: Path) -> None:
    async with open_stage(tmp_path, GradingPolicy(order_check=0.0, calls_per_day=1)) as stage:
        t1, t2 = task_id(32), task_id(33)
        for t in (t1, t2):
            await stage.verified(current(t))
        first = await stage.verified(challenger(t1), partition=1)
        assert isinstance(first.graded()[0].score, Relative)
        second = await stage.verified(challenger(t2), partition=2)  # another partition's call
        assert second.graded()[0].score == Ungraded(reason=UngradedReason.BUDGET_EXHAUSTED)


async def test_what_shadow_runs_spent_is_recorded_once_and_work_runs_are_not_replay(
    stage: Stage,
) -> None:
    t = task_id(12)
    work = current(t)
    await stage.verified(work)  # the work run: not replay
    stage.judge.verdicts = [Verdict.A]
    shadow = challenger(t)
    await stage.verified(shadow)
    await stage.verified(shadow)  # redelivered: its grading ended once, its spend counts once
    reference = current(task_id(13), purpose=Purpose.SHADOW)  # a reference run is replay too
    await stage.verified(reference)
    spent = dict(await stage.log.scan(TENANT, "replay"))
    assert set(spent) == {shadow.run_id, reference.run_id}
    assert [(d["model_calls"], d["tokens"]) for d in spent.values()] == [(1, 12), (1, 12)]


async def test_a_sampled_order_check_records_consistency(tmp_path: Path) -> None:
    async with open_stage(tmp_path, GradingPolicy(order_check=1.0)) as stage:
        t = task_id(10)
        await stage.verified(current(t))
        stage.judge.verdicts = [Verdict.A, Verdict.A]  # the same letter twice: position bias
        out = await stage.verified(challenger(t))
        (graded,) = out.graded()
        assert isinstance(graded.score, Relative)
        assert graded.score.order_consistent is False
        assert graded.judge_calls == 2
        assert len(out.usage()) == 2
        meter = await stage.log.get(StateKey(TENANT, "meter", "grading@0"))
        assert meter is not None
        assert (meter["order_checked"], meter["order_inconsistent"]) == (1, 1)


async def test_a_failed_judge_is_recorded_never_a_guessed_verdict(stage: Stage) -> None:
    t = task_id(11)
    await stage.verified(current(t))
    stage.judge.fail_with = JudgeFailed("answer is not JSON: 'A, I think'")
    out = await stage.verified(challenger(t))
    assert out.graded()[0].score == Ungraded(reason=UngradedReason.JUDGE_FAILED)
    meter = await stage.log.get(StateKey(TENANT, "meter", "grading@0"))
    assert meter is not None
    assert meter["judge_failures"] == 1
    assert "not JSON" in meter["last_failure"]


# -- attempt tournaments -----------------------------------------------------------------------


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


async def test_attempt_ranks_and_step_credit_reach_graded_and_results(stage: Stage) -> None:
    t = task_id(12)
    run = current(t)
    attempts = [
        view(1, AttemptState.FAILED, None, "p"),
        view(2, AttemptState.FAILED, None, "p"),
        view(3, AttemptState.SUCCEEDED, "5", "p, carefully"),
    ]
    wf = graded_workflow("What is {{ task.question }}?", {"strategy": "pairwise_sequential"})
    out = await deliver(
        stage, run.model_copy(update={"workflow_version": wf.version}), wf, "5", attempts=attempts
    )
    (graded,) = out.graded()
    assert [(r.attempt, r.succeeded) for r in graded.attempt_ranks] == [(1, False), (2, False)]
    assert [(c.failed_attempt, c.passed_attempt) for c in graded.step_credit] == [(1, 3), (2, 3)]
    assert graded.judge_calls == 2  # the two failures, in both orders
    (result,) = out.results()
    assert result.step_credit == graded.step_credit
    assert result.step_credit[0].changed == ["prompt (1 -> 12 characters)"]
    assert run.purpose is Purpose.WORK


# -- rollout selection ---------------------------------------------------------------------


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


async def test_rollout_siblings_wait_then_one_selection_is_published(stage: Stage) -> None:
    t = task_id(20)
    runs = [sibling(t, i) for i in range(4)]
    for i, run in enumerate(runs):
        out = await stage.verified(run, passed=i != 2, output="x" * (i + 1))
        assert out.graded() == []
        assert out.by_topic.get(RESULTS, []) == []
        (progress,) = out.by_topic[TASKS]
        assert (progress.run_id, progress.ended) == (run.run_id, "verified")
    stage.judge.prefer_longer = True
    out = await stage.deliver(closed(t, runs))
    (result,) = out.rollout_results()
    assert result.passes == 3
    assert result.pass_at_k == pytest.approx([0.75, 1.0, 1.0, 1.0])
    assert result.winner == runs[3].run_id  # the longest output of those that passed
    assert result.selection.decided_by == "judge"
    assert len(out.graded()) == 4  # each sibling's score within its group
    assert (await stage.deliver(closed(t, runs))).rollout_results() == []  # selected once


async def test_a_selection_redelivered_after_a_crash_asks_the_judge_nothing_twice(
    stage: Stage,
) -> None:
    t = task_id(21)
    runs = [sibling(t, i) for i in range(4)]
    for i, run in enumerate(runs):
        await stage.verified(run, output="x" * (i + 1))
    stage.judge.prefer_longer = True
    stage.judge.crash_after = 3  # the process dies after the third verdict
    out = await stage.deliver(closed(t, runs))  # the runner retries the handler
    (result,) = out.rollout_results()
    assert result.selection.decided_by == "judge"
    asked = stage.judge.compared
    assert len(asked) == len(set(asked)) == 8  # 2 rounds x 2 pairs x 2 orders, once each
