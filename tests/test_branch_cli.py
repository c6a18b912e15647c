"""`assay branch` as a user runs it, in embedded mode: the tree on success, one error line
and exit 2 on bad input or a refused command.

A run is made once per module by the embedded pipeline in this process; then each
invocation is a real subprocess of the installed console script on that data
directory (one at a time: embedded mode holds the directory). Invocations that
fail before touching any data run on an empty directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from assay.bus import TASKS, WORKFLOWS
from assay.kernel import tenant_id
from assay.messages import TaskSubmitted, WorkflowRegistered
from assay.record import StateKey
from assay.runtime.embedded import Embedded
from assay.workflow import load_workflow
from tests.test_cli import ASSAY, assert_usage_error

TENANT = tenant_id(str(uuid.uuid5(uuid.NAMESPACE_URL, "assay:branch-cli")))
WORKFLOW = """\
id: think-solve
steps:
  - {id: think, kind: model, prompt: "Think about {{ task.question }}."}
  - {id: solve, kind: model, prompt: "Reply with only the number. What is {{ task.question }}?"}
  - {id: answer, kind: tool, tool: extract_number, args: {text: "{{ steps.solve.output }}"}}
verifiers:
  - {id: correct, kind: exact, step: answer, expected: "{{ task.answer }}"}
"""
ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith("ASSAY_")},
    "ASSAY_LEASE_TTL_S": "1",
}


async def _make_run(data: Path, workflow: Path) -> str:
    wf = load_workflow(workflow)
    async with Embedded(data) as rt:
        rt.start()
        registered = WorkflowRegistered(
            tenant=TENANT, definition=wf.model_dump(mode="json", by_alias=True)
        )
        await rt.publish(WORKFLOWS, registered, TENANT, idem=wf.version)
        ingest, execute = rt.logs["ingest"], rt.logs["execute"]
        deadline = time.monotonic() + 60
        while await ingest.get(StateKey(TENANT, "allocation", wf.id)) is None:
            assert time.monotonic() < deadline, "the workflow was never registered"
            await asyncio.sleep(0.02)
        task = TaskSubmitted(
            tenant=TENANT,
            workflow_id=wf.id,
            idempotency_key="branch-cli-1",
            input={"question": "(5 + 12) * 9", "answer": "153"},
        )
        await rt.publish(TASKS, task, TENANT, idem=task.idempotency_key)
        while True:
            runs = [run for run, doc in await execute.scan(TENANT, "run") if "episode" in doc]
            if runs:
                return runs[0]
            assert time.monotonic() < deadline, "the run never finished"
            await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A data directory holding one finished run, and the run's id."""
    root = tmp_path_factory.mktemp("branch-cli")
    workflow = root / "think-solve.yaml"
    workflow.write_text(WORKFLOW)
    before = os.environ.get("ASSAY_LEASE_TTL_S")
    os.environ["ASSAY_LEASE_TTL_S"] = "1"  # its lease lapses soon after it stops
    try:
        run = asyncio.run(_make_run(root / "data", workflow))
    finally:
        if before is None:
            del os.environ["ASSAY_LEASE_TTL_S"]
        else:
            os.environ["ASSAY_LEASE_TTL_S"] = before
    return root / "data", run


def assay(data: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ASSAY), "--data-dir", str(data), *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_branch_prints_each_childs_outcome_and_the_stage_it_differs_at(
    made: tuple[Path, str],
) -> None:
    data, run = made
    proc = assay(
        data,
        "branch",
        run,
        "--at",
        "think",
        "--children",
        "3",
        "--delta",
        "prompt:solve=What is {{ task.question }}? Answer in a sentence.",
        "--delta",
        "tool_unavailable:extract_number",
        "--delta",
        "model_params:solve=max_tokens=128,timeout_s=20",
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"branched run {run} after step think (branch 0, lsn ")
    assert lines[0].endswith(": 3 children")
    assert lines[1].startswith(f"  tenant {TENANT}  tree ")
    assert lines[3].startswith("  child 1  branch 1  prompt:solve  succeeded  diverged at solve")
    assert lines[4] == (
        "  child 2  branch 2  tool_unavailable:extract_number  failed at step answer"
        "  diverged at answer: it failed here and succeeded in the parent"
    )
    assert lines[5] == (
        "  child 3  branch 3  model_params:solve(max_tokens=128,timeout_s=20.0)  succeeded"
        "  diverged nowhere"
    )
    assert lines[6] == "  attribution solve: 1; answer: 2; none: 3"

    again = assay(data, "branch", run, "--at", "think", "--json", "--delta", "inject_plan:Go.")
    assert again.returncode == 0, again.stderr
    doc = json.loads(again.stdout)
    tree = doc["tree"]
    assert (tree["kind"], tree["run_id"], tree["boundary"]["step"]) == (
        "assay-branch",
        run,
        "think",
    )
    assert [c["branch"] for c in tree["children"]] == [4]
    ref = doc["tree_ref"]
    assert (data / "blobs" / str(TENANT) / ref[:2] / ref).is_file()

    shown = assay(data, "runs", "show", run)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.count("\n  branched after step think (branch 0, lsn ") == 2


def test_a_refused_branch_is_one_line_with_the_stages_reason(made: tuple[Path, str]) -> None:
    data, run = made
    proc = assay(data, "branch", run, "--at", "think", "--delta", "prompt:think=Again.")
    assert_usage_error(
        proc, "branch refused: ", "child 1: prompt:think: step 'think' ran before the boundary"
    )


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--delta", "nope:x"], ["--delta 'nope:x'", "start with one of prompt, model_params"]),
        (["--delta", "prompt:solve"], ["write prompt:STEP=VALUE"]),
        (["--delta", "model_params:solve=top_p=1"], ["parameters are max_tokens=N"]),
        (["--delta", "model_params:solve=max_tokens=0"], ["max_tokens", "greater than"]),
        (["--delta", "tool_unavailable:x", "--children", "2"], ["--children 2, but 1 children"]),
        ([], ["no children"]),
        (["--deltas", "missing.json"], ["--deltas missing.json", "No such file"]),
    ],
)
def test_bad_branch_input_is_one_line(
    tmp_path: Path, args: list[str], needles: list[str], made: tuple[Path, str]
) -> None:
    _, run = made
    proc = subprocess.run(
        [str(ASSAY), "--data-dir", str(tmp_path / "data"), "branch", run, "--at", "a", *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert_usage_error(proc, *needles)
    assert not (tmp_path / "data").exists()  # refused before anything was written


def test_branching_a_run_that_is_not_there_is_one_line(tmp_path: Path) -> None:
    proc = assay(tmp_path / "data", "branch", "01M8KXHYADJFXV5Q5CDHQJF2PS", "--at", "a")
    assert proc.returncode == 2
    unknown = assay(
        tmp_path / "data", "branch", "01M8KXHYADJFXV5Q5CDHQJF2PS", "--at", "a", "--delta", "x:y"
    )
    assert_usage_error(unknown, "--delta 'x:y'")
    none = assay(
        tmp_path / "data",
        "branch",
        "01M8KXHYADJFXV5Q5CDHQJF2PS",
        "--at",
        "a",
        "--delta",
        "inject_plan:Go.",
    )
    assert_usage_error(none, "no run 01M8KXHYADJFXV5Q5CDHQJF2PS", "no execute log")
    assert_usage_error(
        assay(tmp_path / "data", "branch", "not-a-run", "--at", "a", "--delta", "inject_plan:Go."),
        "not a run id",
    )
