"""The tournament grades a run from the episode its `RunVerified` carries inline (v5),
keeps only the blob's ref of a run it parks, and dead-letters a copy that is not its
blob."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from assay.bus import dlq
from assay.bus.headers import DLQ_REASON
from assay.grading.strategies import GradingPolicy
from assay.kernel.scores import Relative, Ungraded, UngradedReason
from assay.messages import RunRef, RunVerified, Usage, VerifierResult
from services.tournament.tests.tournament_harness import (
    TENANT,
    V1,
    Graded,
    Stage,
    challenger,
    current,
    open_stage,
    task_id,
)


@pytest.fixture
async def stage(tmp_path: Path) -> AsyncIterator[Stage]:
    async with open_stage(tmp_path, GradingPolicy(order_check=0.0)) as opened:
        yield opened


async def carried(stage: Stage, run: RunRef, output: str = "5") -> tuple[str, dict[str, Any]]:
    """Freeze an episode of `run`; its ref and its inline copy."""
    ref = await stage.episode(run, output)
    raw = await stage.blobs.get(TENANT, ref)
    assert raw is not None
    return ref, json.loads(raw)


async def verified_inline(
    stage: Stage, run: RunRef, ref: str, inline: dict[str, Any] | None
) -> Graded:
    msg = RunVerified(
        run=run,
        episode=ref,
        episode_inline=inline,
        passed=True,
        results=[
            VerifierResult(
                verifier="correct", kind="exact", verifier_version="1", passed=True, evidence="ok"
            )
        ],
        usage=Usage(model_calls=1),
        executed=True,
    )
    return await stage.deliver(msg, mid=run.run_id)


async def test_a_run_is_graded_from_its_inline_episode_without_reading_its_blob(
    stage: Stage,
) -> None:
    t = task_id(1)
    cur = current(t)
    ref, inline = await carried(stage, cur)
    await stage.blobs.delete(TENANT, ref)  # were the blob read, it would be ungraded as gone
    out = await verified_inline(stage, cur, ref, inline)
    assert out.score_of(cur) == Ungraded(reason=UngradedReason.NO_REFERENCE)
    reference = await stage.reference(t, V1.version)
    assert reference is not None
    assert reference["episode"] == ref  # what is kept names the blob, the durable copy


async def test_a_parked_run_keeps_its_blobs_ref_and_never_the_inline_copy(
    stage: Stage,
) -> None:
    t = task_id(3)
    cur, chal = current(t), challenger(t, reference_expected=True)
    chal_ref, chal_inline = await carried(stage, chal)
    early = await verified_inline(stage, chal, chal_ref, chal_inline)
    assert early.graded() == []  # parked until its reference arrives
    ((_, parked),) = await stage.log.scan(TENANT, "parked", f"{t}/")
    assert parked["episode"] == chal_ref
    assert "episode_inline" not in parked
    cur_ref, cur_inline = await carried(stage, cur)
    late = await verified_inline(stage, cur, cur_ref, cur_inline)
    assert isinstance(late.score_of(chal), Relative)  # read back from its blob
    assert stage.judge.compared == [(chal.run_id, cur.run_id)]


async def test_an_inline_episode_that_is_not_its_blob_is_dead_lettered(stage: Stage) -> None:
    t = task_id(2)
    cur = current(t)
    ref, _ = await carried(stage, cur, "5")
    _, other = await carried(stage, cur, "6")
    out = await verified_inline(stage, cur, ref, other)
    assert out.graded() == []
    (dead,) = out.by_topic[dlq("tournament")]
    reason = dict(dead.headers)[DLQ_REASON].decode()
    assert f"inline copy of blob {ref} does not match its digest" in reason
    assert await stage.reference(t, V1.version) is None
