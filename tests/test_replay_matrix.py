"""A replay tournament end to end, embedded: a rollout group of heterogeneous candidates.

Two stored versions of the arithmetic workflow and a model variant of the
current one run on the same task as one rollout group, the versions two
siblings each. The result must rank every candidate against the pinned control
(the current version) with an interval, a rank and a pass rate over all its
siblings; the candidates' model calls must be metered as
purpose `replay` (the model variant's under its own model), reserved against
the tenant's replay ceiling when the group was admitted, and never tallied as a
version's evidence. A matrix the replay ceiling cannot hold whole is refused at
submission, naming the candidate, with nothing recorded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from assay.bus import RESULTS, TASKS, USAGE, WORKFLOWS
from assay.kernel import TenantId, tenant_id
from assay.messages import (
    MESSAGES,
    Purpose,
    RolloutResult,
    RolloutSpec,
    TaskSubmitted,
    UsageRecorded,
    WorkflowRegistered,
    open_envelope,
)
from assay.record import StateKey
from assay.runtime import Embedded
from assay.workflow import WorkflowDef, from_document

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TENANT = tenant_id("0c7f8f0e-3c1d-4f7e-9b2a-5d6c7e8f9a01")
OTHER = tenant_id("0c7f8f0e-3c1d-4f7e-9b2a-5d6c7e8f9a02")
CALLS = 3  # each run's model-call budget: what a candidate reserves


def version(prompt: str) -> WorkflowDef:
    return from_document(
        {
            "id": "arith-matrix",
            "budget": {"max_model_calls": CALLS},
            "steps": [
                {"id": "solve", "kind": "model", "prompt": prompt, "max_tokens": 32},
                {
                    "id": "answer",
                    "kind": "tool",
                    "tool": "extract_number",
                    "args": {"text": "{{ steps.solve.output }}"},
                },
            ],
            "verifiers": [
                {
                    "id": "correct",
                    "kind": "exact",
                    "step": "answer",
                    "expected": "{{ task.answer }}",
                }
            ],
            "rubric": [{"id": "concise", "layer": "contextual", "text": "Prefer shorter answers."}],
        }
    )


V1 = version("What is {{ task.question }}?")
V2 = version("Work it out step by step: {{ task.question }}. Reply with only the number.")
MATRIX = RolloutSpec.model_validate(
    {
        "candidates": [
            {"name": "v1", "version": "current"},
            {"name": "v2", "version": V2.version[:16]},
            {"name": "big", "model": "stub-arith-2"},
        ]
    }
)


SIBLINGS = RolloutSpec.model_validate(
    {
        "candidates": [
            {"name": "v1", "version": "current", "samples": 2},
            {"name": "v2", "version": V2.version[:16], "samples": 2},
            {"name": "big", "model": "stub-arith-2"},
        ]
    }
)
SAMPLES = {"v1": 2, "v2": 2, "big": 1}
DRAWN = datetime(2026, 12, 6, 9, 16, 19, 907000, tzinfo=UTC)
"""When the sibling matrix is submitted. A sibling's run id follows from the task's time,
and the stub model's answers from the run id: at this instant both of v1's siblings pass,
one of v2's two and big's one, and big (one pass) is stronger than v1 (two), so the winner
is not the candidate with the most passes. At the wall clock's time the matrix drew a
different case on every run."""
TIE = 1e-9
"""Strengths closer than this are equal (the tournament stage's `TIE`)."""


async def wait_for(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        found = await check()
        if found:
            return found
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def register(rt: Embedded, tenant: TenantId) -> None:
    """V1 current, V2 stored after it (the runtime started)."""
    for wf in (V1, V2):
        document = wf.model_dump(mode="json", by_alias=True)
        registered = WorkflowRegistered(tenant=tenant, definition=document)
        await rt.publish(WORKFLOWS, registered, tenant, idem=wf.version)

        async def stored(wf: WorkflowDef = wf) -> bool:
            key = StateKey(tenant, "definition", wf.version)
            alloc = await rt.logs["ingest"].get(StateKey(tenant, "allocation", wf.id))
            return alloc is not None and await rt.logs["ingest"].get(key) is not None

        await wait_for(stored, 60, f"{wf.version[:12]} to be stored")


async def submit(rt: Embedded, tenant: TenantId, key: str, spec: RolloutSpec = MATRIX) -> None:
    task = TaskSubmitted(
        tenant=tenant,
        workflow_id=V1.id,
        idempotency_key=key,
        input={"question": "17 * 23", "answer": "391"},
        rollout=spec,
    )
    await rt.publish(TASKS, task, tenant, idem=key)


async def messages(rt: Embedded, topic: str, kind: type[Any]) -> list[Any]:
    out = []
    for partition in range(rt.partitions):
        for m in await rt.bus.fetch(topic, partition, 0, 10_000, 0.0):
            env = open_envelope(m.value)
            if env.type == kind.type:
                out.append(MESSAGES.decode(env.type, env.schema_version, env.payload))
    return out


async def result_of(rt: Embedded, key: str) -> RolloutResult | None:
    found = [r for r in await messages(rt, RESULTS, RolloutResult) if r.idempotency_key == key]
    return found[0] if found else None


def ranked_against_control(result: RolloutResult, samples: dict[str, int]) -> dict[str, Any]:
    """Check a matrix of v1 (the control), v2 and the model `big` ranked against v1, each
    candidate with `samples[name]` siblings; its lines by candidate name."""
    assert result.control == "v1"
    lines = {c.name: c for c in result.candidates or []}
    assert list(lines) == ["v1", "v2", "big"]
    assert [c.kind for c in lines.values()] == ["version", "version", "model"]
    assert lines["v1"].workflow_version == V1.version
    assert lines["v2"].workflow_version == V2.version
    assert lines["big"].workflow_version not in (V1.version, V2.version)  # a derived variant
    assert [c.control for c in lines.values()] == [True, False, False]
    for name, c in lines.items():  # every sibling of the candidate counts
        assert c.samples == samples[name]
        assert len(set(c.runs)) == c.verified == samples[name]
        assert c.pass_rate == c.passes / c.verified
    ranked = {name: c for name, c in lines.items() if c.strength is not None}
    assert "v1" in ranked, "the control took part in no comparison"
    control = ranked["v1"].strength
    assert control is not None
    assert control.anchored
    assert control.strength == 0.0
    assert control.interval == (0.0, 0.0)
    strengths = {}
    for name, c in ranked.items():
        assert c.strength is not None
        low, high = c.strength.interval
        assert low <= c.strength.strength <= high
        assert c.rank is not None
        strengths[name] = c.strength.strength
    by_strength = sorted(ranked.values(), key=lambda c: -strengths[c.name])
    assert by_strength[0].rank == 1
    ranks = [c.rank or 0 for c in by_strength]
    assert ranks == sorted(ranks)
    # The recorded policy, verifier_then_judge: the best outcome class (the passing
    # siblings, if any passed), its strongest candidate, that candidate's lowest index
    # there; equal strengths fall to the lowest index. With several siblings a candidate,
    # that candidate need not be the one with the most passes.
    passing = {s.run_id for s in result.siblings if s.passed}
    best = {
        s.run_id
        for s in result.siblings
        if s.ended == "verified" and not s.capped and (s.passed or not passing)
    }
    assert result.winner in best
    contenders = {name: best & set(c.runs) for name, c in ranked.items()}
    top = max(strengths[name] for name, runs in contenders.items() if runs)
    leading = {name for name, runs in contenders.items() if runs and top - strengths[name] < TIE}
    first = min(
        (s for s in result.siblings if any(s.run_id in contenders[n] for n in leading)),
        key=lambda s: s.index,
    )
    assert result.winner == first.run_id
    assert result.passes == sum(c.passes for c in lines.values())
    assert result.estimate is not None
    siblings = sum(samples.values())
    assert result.estimate.model_calls == result.estimate.replay_calls == siblings * CALLS
    assert result.model_calls <= result.estimate.model_calls
    return lines


async def test_a_matrix_of_versions_and_a_model_is_ranked_against_the_pinned_control(
    tmp_path: Path,
) -> None:
    async with Embedded(tmp_path / "data", clock=lambda: DRAWN) as rt:
        rt.start()
        await register(rt, TENANT)
        await submit(rt, TENANT, "matrix-1", SIBLINGS)
        await submit(rt, TENANT, "matrix-1", SIBLINGS)  # admits and reserves nothing more
        result = await wait_for(lambda: result_of(rt, "matrix-1"), 120, "the matrix's result")
        usage = [u for u in await messages(rt, USAGE, UsageRecorded) if u.tenant == TENANT]
        meter = await rt.logs["ingest"].get(StateKey(TENANT, "meter", "replay"))
        tallied = await rt.logs["aggregate"].scan(TENANT, "version")

    lines = ranked_against_control(result, SAMPLES)
    assert [c.passes for c in lines.values()] == [2, 1, 1], "DRAWN no longer draws its case"
    assert result.winner in lines["big"].runs  # the strongest, with fewer passes than v1
    runs = {run for c in lines.values() for run in c.runs}
    calls = [u for u in usage if u.run_id in runs and u.judge_purpose is None]
    assert calls
    assert {u.purpose for u in calls} == {Purpose.REPLAY}  # the candidates' own calls
    judged = [u for u in usage if u.run_id in runs and u.judge_purpose is not None]
    assert {u.purpose for u in judged} <= {Purpose.GRADING}  # the selection's are grading's
    big = set(lines["big"].runs)
    assert {u.model for u in calls if u.run_id in big} == {"stub-arith-2"}
    assert {u.model for u in calls if u.run_id not in big} == {"stub-arith-1"}
    assert meter is not None
    assert meter["calls_today"] == 5 * CALLS  # every sibling's, reserved once, at admission
    assert meter["runs_today"] == 5
    assert tallied == [], "a candidate's run was tallied as a version's evidence"


async def test_a_matrix_the_replay_ceiling_cannot_hold_whole_is_refused_naming_the_candidate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASSAY_REPLAY_CEILINGS", f"{TENANT}={2 * CALLS}")  # two of the three
    async with Embedded(tmp_path / "data") as rt:
        rt.start()
        await register(rt, TENANT)
        await register(rt, OTHER)
        await submit(rt, TENANT, "too-big")
        await submit(rt, OTHER, "fits")  # another tenant's ceiling is its own

        async def refusals() -> list[str]:
            found = []
            for partition in range(rt.partitions):
                for m in await rt.bus.fetch("assay.dlq.ingest", partition, 0, 100, 0.0):
                    found.append(dict(m.headers).get("assay-dlq-reason", b"").decode())
            return found

        (reason,) = await wait_for(refusals, 60, "the refusal")
        other = await wait_for(lambda: result_of(rt, "fits"), 120, "the other tenant's result")
        group = await rt.logs["ingest"].get(StateKey(TENANT, "rollout", "too-big"))
        meter = await rt.logs["ingest"].get(StateKey(TENANT, "meter", "replay"))
        spawned = await rt.logs["execute"].scan(TENANT, "run")
    assert "candidate 'big'" in reason
    assert "replay ceiling of 6" in reason
    assert group is None, "a refused matrix left a group behind"
    assert meter is None, "a refused matrix reserved replay"
    assert spawned == []
    assert other.candidates is not None
    assert len(other.candidates) == 3
