"""Named crash points: the plan, the trace, the kill, and the names commits get."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from assay.crash import (
    CRASH_AT_ENV,
    CRASH_TRACE_ENV,
    CrashPlan,
    CrashPlanInvalid,
    crash_point,
    crash_points_armed,
    reset_crash_points,
)
from assay.engine.events import AttemptFinished, AttemptStarted, Intent
from assay.kernel import (
    AttemptNo,
    AttemptState,
    BranchId,
    IntentState,
    StepId,
    new_run_id,
    tenant_id,
)
from assay.messages import Usage
from assay.record import BranchKey
from assay.runtime.stage import commit_label


@pytest.fixture(autouse=True)
def fresh_plan(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(CRASH_AT_ENV, raising=False)
    monkeypatch.delenv(CRASH_TRACE_ENV, raising=False)
    reset_crash_points()
    yield
    reset_crash_points()


def test_a_plan_names_points_and_the_hit_to_die_on() -> None:
    plan = CrashPlan.parse("execute.after_claim:2, execute.relay.after_ack")
    assert plan is not None
    assert plan.at == {"execute.after_claim": 2, "execute.relay.after_ack": 1}
    assert plan.trace is None
    assert CrashPlan.parse(None) is None
    assert CrashPlan.parse(" , ") is None
    traced = CrashPlan.parse(None, "/tmp/trace")
    assert traced is not None
    assert traced.at == {}
    assert traced.trace == "/tmp/trace"


@pytest.mark.parametrize("bad", ["a:0", "a:x", ":3", "a:-1"])
def test_a_bad_plan_is_refused(bad: str) -> None:
    with pytest.raises(CrashPlanInvalid, match="not <name>:<n>"):
        CrashPlan.parse(bad)


def test_unarmed_points_do_nothing() -> None:
    crash_point("execute.after_claim")
    assert not crash_points_armed()


def test_a_trace_records_every_hit_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = tmp_path / "trace"
    monkeypatch.setenv(CRASH_TRACE_ENV, str(trace))
    monkeypatch.setenv(CRASH_AT_ENV, "never.reached:1")
    reset_crash_points()
    assert crash_points_armed()
    for name in ("a.one", "a.two", "a.one"):
        crash_point(name)
    lines = [line.split(" ") for line in trace.read_text().splitlines()]
    assert [name for name, _, _ in lines] == ["a.one", "a.two", "a.one"]
    assert {int(pid) for _, pid, _ in lines} == {os.getpid()}
    assert all(int(ms) > 0 for _, _, ms in lines)


def test_the_nth_hit_kills_the_process_without_cleanup(tmp_path: Path) -> None:
    trace, marker = tmp_path / "trace", tmp_path / "finally-ran"
    script = (
        "import sys\n"
        "from assay.crash import crash_point\n"
        "try:\n"
        "    crash_point('p.x')\n"
        "    sys.stdout.write('unflushed')\n"
        "    crash_point('p.y')\n"
        "    crash_point('p.x')\n"
        "    print('survived', flush=True)\n"
        "finally:\n"
        f"    open({str(marker)!r}, 'w').close()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env |= {CRASH_AT_ENV: "p.x:2", CRASH_TRACE_ENV: str(trace)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True)
    assert done.returncode == -signal.SIGKILL
    assert done.stdout == b""  # nothing flushed
    assert not marker.exists()  # no `finally`
    assert [line.split(" ")[0] for line in trace.read_text().splitlines()] == [
        "p.x",
        "p.y",
        "p.x",
    ]


def test_commit_labels_name_what_is_committed() -> None:
    key = BranchKey.for_run(tenant_id(str(uuid.uuid4())), new_run_id(), BranchId(0))
    step, n = StepId("charge"), AttemptNo(1)
    pending = Intent(
        step=step,
        attempt=n,
        state=IntentState.PENDING,
        tool="sink_charge",
        effect="unsafe",
        request_id="r",
    )
    committed = pending.model_copy(update={"state": IntentState.COMMITTED})
    finished = AttemptFinished(
        step=step, attempt=n, state=AttemptState.SUCCEEDED, usage=Usage(), duration_ms=1
    )
    started = AttemptStarted(step=step, attempt=n, iteration=0)
    assert commit_label([(key, pending)]) == "Intent.pending.unsafe"
    assert commit_label([(key, started)]) == "AttemptStarted"
    assert (
        commit_label([(key, committed), (key, finished)])
        == "Intent.committed.unsafe+AttemptFinished.succeeded"
    )
    assert commit_label([(key, started), (key, started)]) == "AttemptStarted"
    assert commit_label([]) == "outbox"
