"""The example plugin package end to end, embedded (`examples/plugins`).

The package is installed as pip installs it — a `*.dist-info` with the entry points
its `pyproject.toml` declares, its sources on `sys.path` — and the settings choose its
model, judge, proposer and sandbox provider. A workflow grades by its `single_look`
strategy: the current version's runs give their results, and each challenger episode is
scored by the strategy asking the example judge. A second workflow grades by the
grouped `fewest_tokens` strategy, which ranks each closed group itself (not by the Swiss
tournament) with its own parameter block. A workflow naming a strategy that no package
registers, or giving an installed one parameters its model refuses, is refused at
registration with the reason.
"""

from __future__ import annotations

import asyncio
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from assay.bus import GRADED, RESULTS, TASKS, WORKFLOWS
from assay.bus.topics import dlq
from assay.grading.ladder import LadderPolicy
from assay.kernel import tenant_id
from assay.kernel.scores import DecidedBy, Outcome, Ranked, Relative, Ungraded
from assay.messages import (
    MESSAGES,
    RunGraded,
    RunResult,
    TaskSubmitted,
    WorkflowRegistered,
    open_envelope,
)
from assay.record import StateKey
from assay.runtime import Embedded
from assay.workflow import WorkflowDef, from_document

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "plugins"
TENANT = tenant_id("5d1c0a7e-2b4f-4c1e-9a3d-7e8f9a0b1c2d")
TASKS_EACH = 3


@pytest.fixture
def example_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`examples/plugins` installed into a throwaway site directory."""
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    site = tmp_path / "site"
    dist = site / f"assay_example_plugins-{project['version']}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    lines = []
    for group, entries in project["entry-points"].items():
        lines.append(f"[{group}]")
        lines.extend(f"{name} = {target}" for name, target in entries.items())
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(EXAMPLE / "src"))
    for kind, name in (
        ("MODEL", "adder"),
        ("JUDGE", "fewer_prompt_tokens"),
        ("PROPOSER", "nothing_to_propose"),
        ("SANDBOX", "scratch"),
    ):
        monkeypatch.setenv(f"ASSAY_{kind}_KIND", name)
    yield
    sys.modules.pop("assay_example_plugins", None)


def version(
    prompt: str,
    strategy: str = "single_look",
    wf_id: str = "add-by-plugin",
    **grading: Any,
) -> WorkflowDef:
    return from_document(
        {
            "id": wf_id,
            "grading": {"strategy": strategy, **grading},
            "steps": [{"id": "solve", "kind": "model", "prompt": prompt, "max_tokens": 8}],
            "verifiers": [
                {"id": "sum", "kind": "exact", "step": "solve", "expected": "{{ task.answer }}"}
            ],
        }
    )


V1 = version("What, if you please, is {{ task.question }}?")
V2 = version("Add {{ task.question }}")  # fewer prompt tokens: the example judge prefers it
RANKED: dict[str, Any] = {"strategy": "fewest_tokens", "wf_id": "rank-by-plugin", "quorum": 2}
R1 = version("What, if you please, is {{ task.question }}?", **RANKED, params={"per_token": 0.5})
R2 = version("Add {{ task.question }}", **RANKED, params={"per_token": 0.5})


async def wait_for(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        found = await check()
        if found:
            return found
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def read(rt: Embedded, topic: str) -> list[Any]:
    out = []
    for partition in range(rt.partitions):
        for m in await rt.bus.fetch(topic, partition, 0, 10_000, 0.0):
            env = open_envelope(m.value)
            out.append(MESSAGES.decode(env.type, env.schema_version, env.payload))
    return out


async def register(rt: Embedded, wf: WorkflowDef) -> None:
    document = wf.model_dump(mode="json", by_alias=True)
    await rt.publish(
        WORKFLOWS, WorkflowRegistered(tenant=TENANT, definition=document), TENANT, idem=wf.version
    )


async def test_the_example_plugins_run_a_workflow_to_graded_results(
    tmp_path: Path, example_installed: None
) -> None:
    ladder = LadderPolicy(min_shadow_runs=100)  # the challenger stays on shadow throughout
    async with Embedded(tmp_path / "data", shadow_rate=1.0, ladder=ladder) as rt:
        assert rt.deps.model.name == "adder-1"  # the settings chose the example's kinds
        assert rt.deps.judge.name == "fewer-prompt-tokens-1"
        assert rt.deps.proposer.name == "nothing-to-propose"
        assert rt.deps.sandbox is not None
        assert type(rt.deps.sandbox).__module__ == "assay.sandbox.local"  # `scratch` wraps it
        assert rt.deps.strategies["single_look"].grouped is False
        assert rt.deps.strategies["fewest_tokens"].grouped is True
        rt.start()
        for wf in (V1, V2, R1, R2):
            await register(rt, wf)

            async def routed(wf: WorkflowDef = wf) -> bool:
                alloc = await rt.logs["ingest"].get(StateKey(TENANT, "allocation", wf.id))
                return alloc is not None and wf.version in (
                    alloc["current"],
                    alloc.get("challenger"),
                )

            await wait_for(routed, 60, f"{wf.version[:12]} to be routed")
        for wf_id in (V1.id, R1.id):
            for i in range(TASKS_EACH):
                key = f"{wf_id}-{i}"
                task = TaskSubmitted(
                    tenant=TENANT,
                    workflow_id=wf_id,
                    idempotency_key=key,
                    input={"question": f"{i} + 40", "answer": str(i + 40)},
                )
                await rt.publish(TASKS, task, TENANT, idem=key)

        async def served() -> list[RunResult]:
            found = [m for m in await read(rt, RESULTS) if isinstance(m, RunResult)]
            return found if len(found) == 2 * TASKS_EACH else []

        results = await wait_for(served, 120, "every task's result")
        for r in results:  # the example model answered; the current version is the baseline
            assert r.workflow_version in (V1.version, R1.version)
            assert r.passed, r
            if r.workflow_version == V1.version:
                assert isinstance(r.score, Ungraded)

        async def challenger_scores() -> list[RunGraded]:
            found = [
                m
                for m in await read(rt, GRADED)
                if isinstance(m, RunGraded) and m.run.workflow_version == V2.version
            ]
            return found if len(found) == TASKS_EACH else []

        for graded in await wait_for(challenger_scores, 120, "every challenger episode's score"):
            score = graded.score
            assert isinstance(score, Relative), score  # what `single_look` declares it produces
            assert score.decided_by is DecidedBy.JUDGE
            assert score.position == "a"
            assert score.outcome is Outcome.WIN  # the judge preferred the shorter prompt

        async def ranked_scores() -> list[RunGraded]:
            found = [
                m
                for m in await read(rt, GRADED)
                if isinstance(m, RunGraded) and m.run.workflow_id == R1.id
            ]
            return found if len(found) == 2 * TASKS_EACH else []

        for graded in await wait_for(ranked_scores, 120, "every ranked episode's score"):
            score = graded.score
            assert isinstance(score, Ranked), score  # ranked by fewest_tokens, no judge
            assert (score.group_size, score.anchored, score.comparisons) == (2, True, None)
            # The adder counts a prompt token a word: 8 for R1's prompt, 4 for R2's; the
            # strength is the tokens saved against control times params.per_token (0.5).
            mine = 2.0 if graded.run.workflow_version == R2.version else 0.0
            assert score.strength == mine


async def test_a_workflow_naming_an_unregistered_strategy_is_refused_with_the_reason(
    tmp_path: Path, example_installed: None
) -> None:
    unknown = version("Add {{ task.question }}", strategy="nobody_registers_this")
    bad = version(
        "Add {{ task.question }}", **{**RANKED, "wf_id": "bad-params"}, params={"per_token": 0}
    )
    async with Embedded(tmp_path / "data") as rt:
        rt.start()
        await register(rt, unknown)
        await register(rt, bad)

        async def refused() -> list[str]:
            reasons = []
            for partition in range(rt.partitions):
                for m in await rt.bus.fetch(dlq("ingest"), partition, 0, 100, 0.0):
                    reasons.append(dict(m.headers)["assay-dlq-reason"].decode())
            return reasons

        async def both() -> list[str]:
            reasons = await refused()
            return reasons if len(reasons) == 2 else []

        reason, params = sorted(await wait_for(both, 60, "the registrations to be refused"))
        assert "'nobody_registers_this' is not registered" in reason
        assert "single_look" in reason  # the registered ones are listed
        assert (
            "grading strategy 'fewest_tokens': grading.params.per_token: Input should be "
            "greater than 0"
        ) in params
        for wf in (unknown, bad):
            alloc = await rt.logs["ingest"].get(StateKey(TENANT, "allocation", wf.id))
            assert alloc is None  # nothing half-registered
