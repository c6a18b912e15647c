"""Judge calibration (§11 health metrics): agreement with the verifier on pass/fail pairs,
order inconsistency, failures kept apart; and `assay grade calibrate`."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from assay.cli import main
from assay.grading import (
    CalibrationPair,
    CalibrationReport,
    JudgeFailed,
    JudgeUsage,
    StubJudge,
    UsageCallback,
    calibrate,
)
from assay.grading.calibration_policy import CalibrationPolicy
from assay.kernel.scores import CoreViolation, Verdict
from assay.messages import Episode
from assay.runtime.settings import AssaySettings, SettingsInvalid
from assay.workflow import RubricItem
from libs.assay.tests.chat_endpoint import ChatServer, completion, json_reply
from libs.assay.tests.judge_episodes import RUBRIC, make_episode


@dataclass
class ScriptedJudge:
    """Answers by a rule; fails on tasks whose input says "flaky"; reports one call each."""

    rule: str
    name: str = "scripted"
    max_context_tokens: int = 0
    shown: list[tuple[Episode, Episode, list[RubricItem]]] = field(default_factory=list)

    async def compare(
        self,
        a: Episode,
        b: Episode,
        rubric: list[RubricItem],
        *,
        on_usage: UsageCallback | None = None,
    ) -> Verdict:
        self.shown.append((a, b, rubric))
        if on_usage is not None:
            on_usage(JudgeUsage(self.name, 10, 2, 0.5))
        if a.input.get("flaky"):
            raise JudgeFailed("not one JSON object", "I cannot decide")
        if self.rule == "prefers-the-pass":
            return Verdict.A if a.succeeded else Verdict.B
        if self.rule == "always-a":
            return Verdict.A
        return Verdict.DRAW

    async def screen(
        self,
        episode: Episode,
        rubric: list[RubricItem],
        *,
        on_usage: UsageCallback | None = None,
    ) -> list[CoreViolation]:
        return []


def pair(
    task: str, *, flaky: bool = False, rubric: list[RubricItem] | None = None
) -> CalibrationPair:
    task_input: dict[str, Any] = {"question": task, "flaky": flaky}
    return CalibrationPair(
        task,
        passed=make_episode(["5"], task_input=task_input),
        failed=make_episode([None, None], task_input=task_input),
        rubric=rubric,
    )


PAIRS = [pair("2 + 3"), pair("7 * 6"), pair("9 - 4")]


async def test_a_judge_that_always_prefers_the_pass_agrees_fully_and_consistently() -> None:
    report = await calibrate(ScriptedJudge("prefers-the-pass"), PAIRS, RUBRIC)
    assert (report.pairs, report.judge_calls, report.judged) == (3, 6, 6)
    assert report.agreement == 1.0
    assert report.order_inconsistency_rate == 0.0
    assert (report.draws, report.failures) == (0, 0)
    assert [(d.pass_first, d.fail_first, d.agreed) for d in report.details] == [
        (Verdict.A, Verdict.B, 2)
    ] * 3


async def test_a_position_biased_judge_agrees_half_the_time_and_is_always_inconsistent() -> None:
    report = await calibrate(ScriptedJudge("always-a"), PAIRS, RUBRIC)
    assert report.agreement == 0.5
    assert report.order_inconsistency_rate == 1.0
    assert all(d.consistent is False for d in report.details)


async def test_draws_count_as_disagreement_and_are_counted_apart() -> None:
    report = await calibrate(ScriptedJudge("always-draw"), PAIRS, RUBRIC)
    assert (report.agreement, report.draws) == (0.0, 6)
    assert report.order_inconsistency_rate == 0.0  # a draw mirrors a draw


async def test_failures_are_counted_with_reasons_and_excluded_from_the_rates() -> None:
    report = await calibrate(
        ScriptedJudge("prefers-the-pass"), [pair("2 + 3"), pair("1 / 0", flaky=True)], RUBRIC
    )
    assert (report.judge_calls, report.judged, report.failures) == (4, 2, 2)
    assert report.agreement == 1.0
    assert report.order_inconsistency_rate == 0.0  # over the one pair judged both ways
    assert [(f.task, f.order) for f in report.failure_reasons] == [
        ("1 / 0", "pass_first"),
        ("1 / 0", "fail_first"),
    ]
    assert "I cannot decide" in report.failure_reasons[0].reason
    flaky = report.details[1]
    assert (flaky.pass_first, flaky.fail_first, flaky.consistent) == (None, None, None)
    assert (report.model_calls, report.prompt_tokens, report.cost_usd) == (4, 40, 2.0)


async def test_nothing_judged_has_no_rates() -> None:
    report = await calibrate(ScriptedJudge("always-a"), [pair("x", flaky=True)], RUBRIC)
    assert (report.agreement, report.order_inconsistency_rate) == (None, None)


async def test_each_pair_is_judged_by_its_own_rubric_else_the_given_one_else_its_definitions() -> (
    None
):
    own = [RubricItem(id="own", layer="contextual", text="Own.")]
    given = [RubricItem(id="given", layer="contextual", text="Given.")]
    judge = ScriptedJudge("always-a")
    await calibrate(judge, [pair("a", rubric=own), pair("b")], given)
    await calibrate(judge, [pair("c")], None)
    assert [[i.id for i in r] for _, _, r in judge.shown] == [
        ["own"],
        ["own"],
        ["given"],
        ["given"],
        [i.id for i in RUBRIC],
        [i.id for i in RUBRIC],
    ]
    shown_first = [(a.succeeded, b.succeeded) for a, b, _ in judge.shown[:2]]
    assert shown_first == [(True, False), (False, True)]  # pass as A, then fail as A


# -- assay grade calibrate -------------------------------------------------------------------


def line(task: str, passed: Episode, failed: Episode, **extra: Any) -> str:
    return json.dumps(
        {
            "task": task,
            "passed": passed.model_dump(mode="json"),
            "failed": failed.model_dump(mode="json"),
            **extra,
        }
    )


@pytest.fixture
def calibration_set(tmp_path: Path) -> Path:
    path = tmp_path / "calibration.jsonl"
    path.write_text(
        line("2 + 3", make_episode(["5"]), make_episode([None, "7"]))
        + "\n\n"
        + line(
            "7 * 6",
            make_episode(["42"]),
            make_episode(["41", "40"]),
            rubric=[{"id": "exact", "layer": "prescriptive", "text": "Exact numbers only."}],
        )
        + "\n"
    )
    return path


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        main(["grade", "calibrate", *args])
    out, err = capsys.readouterr()
    return int(done.value.code or 0), out, err


@pytest.fixture
def server() -> Iterator[ChatServer]:
    with ChatServer() as chat:
        yield chat


def test_calibrate_prints_the_report_as_json(
    calibration_set: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A whole judge configuration, unreachable: ignored without --judge-from-env. (A URL
    # alone is refused at start-up, whatever the command: settings are read as one tree.)
    monkeypatch.setenv("ASSAY_JUDGE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("ASSAY_JUDGE_NAME", "unreachable")
    code, out, err = run_cli(capsys, "--set", str(calibration_set))
    assert (code, err) == (0, "")
    report = CalibrationReport.model_validate_json(out)
    assert (report.pairs, report.agreement, report.order_inconsistency_rate) == (2, 1.0, 0.0)
    assert [d.task for d in report.details] == ["2 + 3", "7 * 6"]
    assert report.model_calls == 4  # the stub judge's zero-token calls


def test_calibrate_with_the_judge_from_the_environment(
    calibration_set: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    server: ChatServer,
) -> None:
    monkeypatch.setenv("ASSAY_JUDGE_URL", server.base_url)
    monkeypatch.setenv("ASSAY_JUDGE_NAME", "judge-model")
    monkeypatch.setenv("ASSAY_JUDGE_PRICE_PROMPT_PER_MTOK", "1000")
    server.answer(json_reply(completion('{"verdict": "A"}', prompt_tokens=100)))
    code, out, err = run_cli(capsys, "--set", str(calibration_set), "--judge-from-env")
    assert (code, err) == (0, "")
    report = json.loads(out)
    assert (report["agreement"], report["order_inconsistency_rate"]) == (0.5, 1.0)
    assert report["cost_usd"] == pytest.approx(4 * 100 * 1000 / 1e6)
    systems = [s.body["messages"][0]["content"] for s in server.seen]
    assert len(systems) == 4
    assert "- honest (prescriptive)" in systems[0]  # the definition's rubric
    assert "- exact (prescriptive): Exact numbers only." in systems[2]  # the line's own
    assert "honest" not in systems[2]


def assert_one_line_error(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2
    assert out == ""
    (message,) = err.splitlines()
    assert message.startswith("assay: error: ")
    for needle in needles:
        assert needle in message, message


def test_a_missing_set_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.jsonl"
    assert_one_line_error(*run_cli(capsys, "--set", str(missing)), str(missing), "No such file")


@pytest.mark.parametrize(
    ("second_line", "needles"),
    [
        ('{"task": "x", "passed": ', (":3:", "not a calibration line (not JSON")),
        ("[1, 2]", (":3:", "not a JSON object")),
        ('{"task": "x", "passed": {}, "failed": {}}', (":3:", "passed.run: Field required")),
        ('{"task": "x", "episodes": []}', (":3:", "not a calibration line")),
    ],
)
def test_a_malformed_line_is_one_line_naming_its_number(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], second_line: str, needles: tuple[str, ...]
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line("ok", make_episode(["5"]), make_episode([None])) + "\n\n" + second_line)
    assert_one_line_error(*run_cli(capsys, "--set", str(path)), str(path), *needles)


def test_an_episode_pinning_no_workflow_needs_a_rubric_on_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bare.jsonl"
    bare = make_episode(["5"], definition={"id": "wf"})
    path.write_text(line("x", bare, make_episode([None])) + "\n")
    code, out, err = run_cli(capsys, "--set", str(path))
    assert_one_line_error(code, out, err, f"{path}:1", "not a workflow", "line a rubric")
    path.write_text(line("x", bare, make_episode([None]), rubric=[]) + "\n")
    code, _, err = run_cli(capsys, "--set", str(path))
    assert (code, err) == (0, "")


def test_an_empty_set_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    assert_one_line_error(*run_cli(capsys, "--set", str(path)), "no calibration pairs")


async def test_the_stub_judge_prefers_the_pass_that_took_fewer_attempts() -> None:
    report = await calibrate(StubJudge(), PAIRS, RUBRIC)
    assert (report.agreement, report.order_inconsistency_rate) == (1.0, 0.0)


def test_a_line_whose_episodes_belong_to_two_tenants_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pair is one tenant's: scheduled calibration judges each tenant on its own lines."""
    passed = make_episode(["5"])
    other = passed.run.model_copy(update={"tenant": uuid.UUID(int=7)})
    failed = make_episode([None]).model_copy(update={"run": other})
    path = tmp_path / "mixed.jsonl"
    path.write_text(line("x", passed, failed) + "\n")
    code, out, err = run_cli(capsys, "--set", str(path))
    assert_one_line_error(code, out, err, f"{path}:1", "belong to different tenants")


async def test_every_call_is_also_reported_to_the_callers_meter() -> None:
    judge = ScriptedJudge("prefers-the-pass")
    seen: list[JudgeUsage] = []
    report = await calibrate(judge, PAIRS, None, on_usage=seen.append)
    assert len(seen) == report.model_calls == 6
    assert sum(u.cost_usd for u in seen) == report.cost_usd


@pytest.mark.parametrize(
    ("agreement", "judged", "held"),
    [(0.6, 10, True), (0.7, 10, False), (0.0, 3, False), (None, 0, False), (0.65, 4, True)],
)
def test_promotion_is_held_below_the_threshold_on_enough_orderings(
    agreement: float | None, judged: int, held: bool
) -> None:
    policy = CalibrationPolicy(interval_s=60, min_agreement=0.7, min_judged=4)
    why = policy.hold(agreement, judged)
    assert (why is not None) == held
    if why is not None:
        assert why.endswith(f"over {judged} calibration orderings is below 70%")


@pytest.mark.parametrize(
    ("variable", "value", "needle"),
    [
        ("ASSAY_CALIBRATION_INTERVAL_S", "0", "greater than 0"),
        ("ASSAY_CALIBRATION_MIN_AGREEMENT", "1.5", "less than or equal to 1"),
        ("ASSAY_CALIBRATION_BUDGETS", "acme=3", "not a tenant UUID"),
    ],
)
def test_a_bad_calibration_setting_names_its_variable(
    variable: str, value: str, needle: str
) -> None:
    with pytest.raises(SettingsInvalid, match=variable) as caught:
        AssaySettings.from_env({variable: value})
    assert needle in str(caught.value)
