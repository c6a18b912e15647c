"""The suspension simulator and the decision log give the numbers worked out by hand."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from assay.cli import main
from assay.fleet import Gates, Policy, Trace, WaitKind, simulate
from assay.fleet.plan import plan
from libs.assay.tests.fleet_traces import run

# A: 2 cores, 4 GiB, 100 s; one 60 s model wait. Idle 10 s, checkpoint 2 s, resume 3 s:
#    released 60 - 12 = 48 s, added 3 s, held 100 + 3 - 48 = 55 s.
A = run(100_000, ("model", 10_000, 70_000), cpu_cores=2, memory_gib=4)
# B: 1 core, 8 GiB, 50 s; a 5 s human wait (not over idle_after) and an 11 s tool wait
#    that ends mid-checkpoint: released 0, added 3 + (12 - 11) = 4 s, held 54 s.
B = run(50_000, ("human", 1_000, 6_000), ("tool", 20_000, 31_000), cpu_cores=1, memory_gib=8)
POLICY = Policy.from_seconds(10, checkpoint_s=2, resume_s=3)


def test_two_traces_by_hand() -> None:
    r = simulate([A, B], POLICY)
    assert r.suspensions == 2
    assert (r.always_on_cpu_core_s, r.suspended_cpu_core_s) == (250.0, 164.0)  # 200+50, 110+54
    assert (r.always_on_memory_gib_s, r.suspended_memory_gib_s) == (
        800.0,
        652.0,
    )  # 400+400, 220+432
    assert r.cpu_saving == pytest.approx(86 / 250)
    assert r.memory_saving == pytest.approx(148 / 800)
    assert (r.baseline_ms, r.added_ms) == (150_000, 7_000)
    assert r.overhead == pytest.approx(7 / 150)
    # CPU clears the seed's gate, memory does not: one resource cannot hide the other
    assert r.verdict(Gates()) == ["memory saving 18.50% < 20.00%"]
    assert r.verdict(Gates(min_memory_saving=0.18)) == []
    assert r.verdict(Gates(min_memory_saving=0.18, max_overhead=0.04)) == ["overhead 4.67% > 4.00%"]


def test_only_the_kinds_the_policy_names_are_suspended() -> None:
    r = simulate([B], Policy.from_seconds(10, 2, 3, kinds=[WaitKind.MODEL]))
    assert (r.suspensions, r.added_ms, r.cpu_saving) == (0, 0, 0.0)


def test_the_decision_log_by_hand() -> None:
    decisions = [d.to_json() for d in plan(A, POLICY)]
    assert decisions == [
        {
            "decision": "would_suspend",
            "t_ms": 20_000,
            "trace_t_ms": 20_000,
            "wait_kind": "model",
            "reason": "sandbox idle 10 s in a model wait (idle_after)",
            "released_ms": 48_000,
            "added_latency_ms": 3_000,
            "ready_t_ms": 22_000,
        },
        {
            "decision": "would_resume",
            "t_ms": 70_000,
            "trace_t_ms": 70_000,
            "wait_kind": "model",
            "reason": "the model wait finished",
            "released_ms": 48_000,
            "added_latency_ms": 3_000,
            "ready_t_ms": 73_000,
        },
    ]
    # the second suspended wait's times move by the first resume's latency
    two = run(100_000, ("model", 0, 30_000), ("tool", 40_000, 60_000))
    later = [(d.decision, d.t_ms, d.trace_t_ms) for d in plan(two, POLICY)]
    assert later[2:] == [("would_suspend", 53_000, 50_000), ("would_resume", 63_000, 60_000)]


@st.composite
def traces(draw: st.DrawFn) -> Trace:
    """Runs of random waits and gaps (ms), random sandbox sizes."""
    t, waits = 0, []
    for _ in range(draw(st.integers(0, 8))):
        t += draw(st.integers(0, 50_000))
        w = draw(st.integers(0, 200_000))
        kind = draw(st.sampled_from(["model", "tool", "human"]))
        waits.append((kind, t, t + w))
        t += w
    t += draw(st.integers(0, 50_000))
    cores = draw(st.sampled_from([0.5, 1, 2, 8]))
    gib = draw(st.sampled_from([0.25, 1, 4, 32]))
    return run(t, *waits, cpu_cores=cores, memory_gib=gib)


@settings(max_examples=200, deadline=None)
@given(st.lists(traces(), min_size=1, max_size=5), st.integers(0, 300_000))
def test_free_checkpoints_never_cost_resource_time(ts: list[Trace], idle_ms: int) -> None:
    r = simulate(ts, Policy(idle_after_ms=idle_ms))
    assert r.suspended_cpu_core_s <= r.always_on_cpu_core_s
    assert r.suspended_memory_gib_s <= r.always_on_memory_gib_s
    assert r.added_ms == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(traces(), min_size=1, max_size=5), st.integers(0, 10_000), st.integers(0, 10_000))
def test_no_wait_over_idle_after_means_no_overhead(ts: list[Trace], ckpt: int, res: int) -> None:
    longest = max((w.duration_ms for t in ts for w in t.waits()), default=0)
    r = simulate(ts, Policy(idle_after_ms=longest, checkpoint_ms=ckpt, resume_ms=res))
    assert (r.overhead, r.suspensions) == (0.0, 0)
    assert r.suspended_cpu_core_s == r.always_on_cpu_core_s


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as exit_:
            return int(exit_.code or 0), out.getvalue(), err.getvalue()
    raise AssertionError("main() returned without exiting")


def test_the_command_prints_the_figures_and_exits_by_the_gate(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text(A.to_jsonl())
    (tmp_path / "b.jsonl").write_text(B.to_jsonl())
    flags = ["--idle-after", "10", "--checkpoint-s", "2", "--resume-s", "3"]
    code, out, _ = cli("fleet", "simulate", str(tmp_path), *flags)
    doc = json.loads(out)
    assert code == 1
    assert doc["gate"] == {"passed": False, "reasons": ["memory saving 18.50% < 20.00%"]}
    assert doc["result"]["suspended"] == {
        "completion_seconds": 157.0,
        "cpu_core_seconds": 164.0,
        "memory_gib_seconds": 652.0,
    }
    code, out, _ = cli("fleet", "simulate", str(tmp_path), *flags, "--min-memory-saving", "0.18")
    assert code == 0
    assert json.loads(out)["gate"]["passed"] is True
    code, out, _ = cli("fleet", "plan", str(tmp_path / "a.jsonl"), *flags)
    assert code == 0
    assert [json.loads(line)["decision"] for line in out.splitlines()] == [
        "would_suspend",
        "would_resume",
    ]


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ('{"type": "header", "format": "assay.fleet.trace", "version": 9}\n', ":1: version:"),
        (A.to_jsonl().replace('"t_ms": 70000', '"t_ms": 5'), ":4: order:"),
        ("\n".join(A.to_jsonl().splitlines()[:3]) + "\n", ":4: unfinished:"),
        ("{not json\n", ":1: json:"),
    ],
)
def test_bad_traces_fail_with_the_place_and_exit_2(
    tmp_path: Path, content: str, needle: str
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    for command in (["simulate", str(bad)], ["plan", str(bad)], ["validate", str(tmp_path)]):
        code, out, err = cli("fleet", *command)
        assert (code, out) == (2, ""), err
        assert f"{bad}{needle}" in err
    code, _, err = cli("fleet", "simulate", str(bad), "--kinds", "model,nap")
    assert code == 2
    assert "unknown wait kind 'nap'" in err
