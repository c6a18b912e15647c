"""The verify stage: fail-closed verification of frozen episodes."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from assay.bus import EPISODES, RUN_COMMANDS
from assay.engine import BUILTIN_TOOLS, StubModel
from assay.grading import StubJudge
from assay.kernel import AttemptNo, AttemptState, RunState, StepId, TaskId, TenantId, new_run_id
from assay.messages import (
    AttemptView,
    CancelGrading,
    Episode,
    GradingCancelled,
    Purpose,
    Role,
    RunBranch,
    RunExecuted,
    RunRef,
    RunStatusChanged,
    RunVerified,
    Usage,
)
from assay.runtime import StageDeps, StageHarness
from assay.sandbox import LocalSandbox
from assay.store import FsBlobStore
from assay.workflow import WorkflowDef, load_workflow
from assay_verify import create_stage

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
TENANT = TenantId(uuid.UUID(int=11))
OTHER = TenantId(uuid.UUID(int=12))


@pytest.fixture
async def stage(tmp_path: Path) -> AsyncIterator[StageHarness]:
    blobs = FsBlobStore(tmp_path / "blobs")
    deps = StageDeps(blobs=blobs, model=StubModel(), judge=StubJudge(), tools=dict(BUILTIN_TOOLS))
    async with StageHarness(create_stage(deps), blobs, tmp_path) as h:
        yield h


def episode(answer: str, *, tenant: TenantId = TENANT, succeeded: bool = True) -> Episode:
    wf = load_workflow(EXAMPLES / "workflows" / "arith-v1.yaml")
    ref = RunRef(
        tenant=tenant,
        run_id=new_run_id(),
        task_id=TaskId("ab" * 32),
        idempotency_key="k",
        workflow_id=wf.id,
        workflow_version=wf.version,
        role=Role.CURRENT,
        purpose=Purpose.WORK,
    )
    views = [
        AttemptView(
            step=StepId(step),
            attempt=AttemptNo(1),
            iteration=0,
            state=AttemptState.SUCCEEDED,
            output=out,
            usage=Usage(),
            duration_ms=1,
        )
        for step, out in (("solve", f"The answer is {answer}."), ("answer", answer))
    ]
    return Episode(
        run=ref,
        definition=wf.model_dump(mode="json", by_alias=True),
        input={"question": "2 + 3", "answer": "5"},
        attempts=views,
        outputs={"solve": f"The answer is {answer}.", "answer": answer},
        output=answer if succeeded else None,
        succeeded=succeeded,
        failed_step=None if succeeded else StepId("answer"),
        usage=Usage(),
    )


async def executed(
    stage: StageHarness, ep: Episode, *, store_as: TenantId | None = None
) -> RunExecuted:
    ref = await stage.blobs.put(store_as or ep.run.tenant, ep.encode())
    return RunExecuted(run=ep.run, episode=ref, succeeded=ep.succeeded, usage=Usage())


async def verdict(stage: StageHarness) -> RunVerified:
    (out,) = await stage.emitted(topic="assay.verified")
    assert isinstance(out, RunVerified)
    return out


async def test_a_correct_answer_passes(stage: StageHarness) -> None:
    ep = episode("5")
    await stage.deliver(EPISODES, await executed(stage, ep), TENANT)
    v = await verdict(stage)
    assert v.passed
    assert [(r.verifier, r.passed) for r in v.results] == [("correct", True), ("integer", True)]
    (status,) = await stage.emitted(topic="assay.run-status")
    assert isinstance(status, RunStatusChanged)
    assert status.state is RunState.VERIFIED_PASS
    doc = await stage.state(TENANT, "verdict", ep.run.run_id)
    assert doc is not None
    assert doc["passed"] is True


async def test_a_wrong_answer_fails_with_evidence(stage: StageHarness) -> None:
    await stage.deliver(EPISODES, await executed(stage, episode("6")), TENANT)
    v = await verdict(stage)
    assert not v.passed
    assert "expected '5', got '6'" in v.results[0].evidence


async def test_a_failed_execution_never_passes(stage: StageHarness) -> None:
    await stage.deliver(EPISODES, await executed(stage, episode("5", succeeded=False)), TENANT)
    assert not (await verdict(stage)).passed


async def test_a_missing_episode_fails_closed(stage: StageHarness) -> None:
    msg = RunExecuted(run=episode("5").run, episode="0" * 64, succeeded=True, usage=Usage())
    await stage.deliver(EPISODES, msg, TENANT)
    v = await verdict(stage)
    assert not v.passed
    assert "missing" in v.results[0].evidence


async def test_an_undecodable_episode_fails_closed(stage: StageHarness) -> None:
    ref = await stage.blobs.put(TENANT, b'{"not": "an episode"}')
    msg = RunExecuted(run=episode("5").run, episode=ref, succeeded=True, usage=Usage())
    await stage.deliver(EPISODES, msg, TENANT)
    v = await verdict(stage)
    assert not v.passed
    assert "does not decode" in v.results[0].evidence


async def test_another_tenants_episode_is_not_readable(stage: StageHarness) -> None:
    ep = episode("5")
    msg = await executed(stage, ep, store_as=OTHER)  # the blob exists, under another tenant
    await stage.deliver(EPISODES, msg, TENANT)
    v = await verdict(stage)
    assert not v.passed
    assert "missing" in v.results[0].evidence


# -- command verifiers run in the sandbox the stage is given -------------------------------

COMMAND_CHECK = {
    "id": "checked",
    "kind": "command",
    "argv": ["sh", "-c", 'test "$(cat output.txt)" = "{{ task.answer }}"'],
    "timeout_s": 10,
}


def with_command_check(ep: Episode) -> Episode:
    wf = WorkflowDef.model_validate(ep.definition)
    doc = wf.model_dump(mode="json", by_alias=True)
    doc["verifiers"] = [*doc["verifiers"], COMMAND_CHECK]
    return ep.model_copy(update={"definition": doc})


@pytest.fixture
async def sandboxed(tmp_path: Path) -> AsyncIterator[StageHarness]:
    blobs = FsBlobStore(tmp_path / "blobs")
    deps = StageDeps(
        blobs=blobs,
        model=StubModel(),
        judge=StubJudge(),
        tools=dict(BUILTIN_TOOLS),
        sandbox=LocalSandbox(tmp_path / "workspaces", blobs),
    )
    async with StageHarness(create_stage(deps), blobs, tmp_path) as h:
        yield h


@pytest.mark.parametrize(("answer", "passed"), [("5", True), ("6", False)])
async def test_a_command_verifier_runs_in_the_stages_sandbox(
    sandboxed: StageHarness, answer: str, passed: bool
) -> None:
    ep = with_command_check(episode(answer))
    await sandboxed.deliver(EPISODES, await executed(sandboxed, ep), TENANT)
    v = await verdict(sandboxed)
    by_id = {r.verifier: r for r in v.results}
    assert by_id["checked"].kind == "command"
    assert by_id["checked"].passed is passed, by_id["checked"].evidence
    assert v.passed is passed


async def test_a_command_verifier_without_a_sandbox_fails_closed(stage: StageHarness) -> None:
    await stage.deliver(EPISODES, await executed(stage, with_command_check(episode("5"))), TENANT)
    v = await verdict(stage)
    assert not v.passed
    by_id = {r.verifier: r for r in v.results}
    assert by_id["correct"].passed
    assert not by_id["checked"].passed
    assert "no sandbox" in by_id["checked"].evidence


async def test_an_episode_naming_another_tenant_fails_closed(stage: StageHarness) -> None:
    ep = episode("5", tenant=OTHER)
    msg = await executed(stage, ep, store_as=TENANT)  # stored under TENANT, claims OTHER
    await stage.deliver(EPISODES, msg.model_copy(update={"run": episode("5").run}), TENANT)
    v = await verdict(stage)
    assert not v.passed
    assert "another tenant" in v.results[0].evidence


class Counting:
    """A verifier that counts its calls (wrapping the real one)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.kind, self.version = inner, inner.kind, inner.version
        self.calls = 0

    async def check(self, spec: Any, episode: Episode, subject: str) -> tuple[bool, str]:
        self.calls += 1
        result: tuple[bool, str] = await self.inner.check(spec, episode, subject)
        return result


def counting(stage: StageHarness) -> list[Counting]:
    registry = stage.spec.deps.registry
    for kind in ("exact", "regex"):
        registry[kind] = Counting(registry[kind])
    return [registry["exact"], registry["regex"]]


def cancel_of(msg: RunExecuted) -> CancelGrading:
    return CancelGrading(run=msg.run, reason="stop", succeeded=msg.succeeded, usage=msg.usage)


async def test_a_branch_cancelled_before_it_is_verified_runs_no_verifier(
    stage: StageHarness,
) -> None:
    verifiers = counting(stage)
    msg = await executed(stage, episode("5"))
    await stage.deliver(RUN_COMMANDS, cancel_of(msg), TENANT)
    await stage.deliver(EPISODES, msg, TENANT)  # queued before the cancel: never verified
    assert [v.calls for v in verifiers] == [0, 0]
    out = await stage.emitted()
    assert [type(m) for m in out] == [GradingCancelled]
    (told,) = out
    assert isinstance(told, GradingCancelled)
    assert (told.run, told.verified, told.succeeded) == (msg.run, False, True)
    assert await stage.state(TENANT, "verdict", msg.run.run_id) is None


async def test_a_cancel_after_verification_keeps_the_verdict_and_tells_grading(
    stage: StageHarness,
) -> None:
    verifiers = counting(stage)
    msg = await executed(stage, episode("5"))
    await stage.deliver(EPISODES, msg, TENANT)
    await stage.deliver(RUN_COMMANDS, cancel_of(msg), TENANT)
    assert [v.calls for v in verifiers] == [1, 1]  # the work was done; the record stands
    (told,) = [m for m in await stage.emitted() if isinstance(m, GradingCancelled)]
    assert told.verified
    assert await stage.state(TENANT, "verdict", msg.run.run_id) is not None


async def test_a_cancelled_branch_leaves_its_other_branches_verified(
    stage: StageHarness,
) -> None:
    verifiers = counting(stage)
    msg = await executed(stage, episode("5"))
    fork = msg.model_copy(
        update={"run": msg.run.model_copy(update={"branch": RunBranch(branch=1, parent=0)})}
    )
    await stage.deliver(RUN_COMMANDS, cancel_of(msg), TENANT)  # branch 0 only
    await stage.deliver(EPISODES, fork, TENANT)
    assert [v.calls for v in verifiers] == [1, 1]
    (verified,) = [m for m in await stage.emitted() if isinstance(m, RunVerified)]
    assert verified.run.branch == RunBranch(branch=1, parent=0)
    assert await stage.state(TENANT, "verdict", f"{msg.run.run_id}@1") is not None


def inline(ep: Episode) -> dict[str, Any]:
    """The episode as it travels inline in a `RunExecuted` (v5)."""
    return dict(json.loads(ep.encode()))


async def test_an_inline_episode_is_verified_without_reading_its_blob(
    stage: StageHarness,
) -> None:
    ep = episode("5")
    msg = await executed(stage, ep)
    await stage.blobs.delete(TENANT, msg.episode)  # were the blob read, the verdict would fail
    carried = msg.model_copy(update={"episode_inline": inline(ep)})
    await stage.deliver(EPISODES, carried, TENANT)
    v = await verdict(stage)
    assert v.passed
    assert v.episode == msg.episode
    assert v.episode_inline == carried.episode_inline  # passed on for the tournament


async def test_an_inline_episode_that_is_not_its_blob_is_dead_lettered(
    stage: StageHarness,
) -> None:
    ep = episode("5")
    msg = await executed(stage, ep)
    forged = inline(episode("6"))  # a wrong answer under the right answer's ref
    await stage.deliver(EPISODES, msg.model_copy(update={"episode_inline": forged}), TENANT)
    assert await stage.emitted(topic="assay.verified") == []
    ((_, reason),) = await stage.dead_letters()
    assert f"inline copy of blob {msg.episode} does not match its digest" in reason
    assert await stage.state(TENANT, "verdict", ep.run.run_id) is None
