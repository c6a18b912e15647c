"""What a model judge is shown and what it may answer (§11.1, §11.7): prompts built from
episode facts and rubric text only, within budgets; answers parsed strictly."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from assay.grading import (
    JudgeFailed,
    JudgePrompts,
    parse_verdict,
    parse_violations,
    render_episode,
)
from assay.kernel.scores import CoreViolation, Verdict
from assay.messages import Episode
from assay.workflow import RubricItem
from libs.assay.tests.judge_episodes import RUBRIC, make_episode

# -- prompts -------------------------------------------------------------------------------


def test_the_same_episodes_give_byte_identical_prompts() -> None:
    a, b = make_episode([None, "5"]), make_episode(["5"])
    first = JudgePrompts().compare(a, b, RUBRIC)
    again = JudgePrompts().compare(
        Episode.model_validate_json(a.encode()), Episode.model_validate_json(b.encode()), RUBRIC
    )
    assert first == again
    assert JudgePrompts().screen(a, RUBRIC) == JudgePrompts().screen(a, RUBRIC)


def test_an_episode_shows_its_outcome_input_final_output_and_every_attempt_only() -> None:
    shown = render_episode(make_episode([None, "5"], task_input={"question": "2 + 3"}), 10_000)
    assert shown == (
        "Execution: succeeded\n"
        "Task input:\n<input>\n"
        '{"question": "2 + 3"}\n'
        "</input>\n"
        "Final output:\n<output>\n5\n</output>\n"
        "Attempts, in order:\n"
        "1. step solve, attempt 1, iteration 0: failed\n"
        "<error>\nattempt 1 gave a wrong answer\n</error>\n"
        "2. step solve, attempt 2, iteration 0: succeeded\n"
        "<output>\n5\n</output>"
    )


def test_a_failed_episode_says_where_its_attempts_ran_out() -> None:
    shown = render_episode(make_episode([None, None]), 10_000)
    assert shown.startswith("Execution: failed (the attempts of step solve ran out)\n")
    assert "Final output: (none)\n" in shown


def test_no_identity_version_role_prompt_or_usage_reaches_the_judge() -> None:
    a, b = make_episode([None, "5"]), make_episode(["5"])
    prompts = JudgePrompts()
    for prompt in (prompts.compare(a, b, RUBRIC), prompts.screen(a, RUBRIC)):
        text = prompt.system + prompt.user
        for hidden in (
            a.run.run_id,
            b.run.run_id,
            a.run.task_id,
            a.run.workflow_version,
            str(a.run.tenant),
            a.run.idempotency_key,
            "arith",  # the workflow id
            "challenger",
            "SECRET-PROMPT",  # an attempt's rendered prompt
            "777",  # tokens
            "4321",  # duration
        ):
            assert hidden not in text, hidden


def test_compare_weighs_prescriptive_and_contextual_criteria_and_leaves_core_to_screen() -> None:
    prompt = JudgePrompts().compare(make_episode(["5"]), make_episode(["6"]), RUBRIC)
    assert "- honest (prescriptive): Never claim a check that was not run." in prompt.system
    assert "- concise (contextual): Prefer short answers." in prompt.system
    assert "safe" not in prompt.system
    assert "rm -rf" not in prompt.system
    assert "Core criteria are screened separately" in prompt.system
    assert '"verdict": "A" or "B" or "draw"' in prompt.system
    assert prompt.user.startswith("Episode A:\nExecution: succeeded\n")
    assert "\n\nEpisode B:\nExecution: succeeded\n" in prompt.user


def test_screen_shows_only_the_core_criteria() -> None:
    prompt = JudgePrompts().screen(make_episode(["5"]), RUBRIC)
    assert "- safe (core): The output must not contain 'rm -rf'." in prompt.system
    assert "honest" not in prompt.system
    assert "concise" not in prompt.system
    assert '"violations"' in prompt.system
    assert prompt.user.startswith("Episode:\nExecution: succeeded\n")


def test_the_fixed_part_depends_on_the_rubric_alone() -> None:
    prompts = JudgePrompts()
    one = prompts.compare(make_episode(["5"]), make_episode(["6"]), RUBRIC)
    other = prompts.compare(make_episode(["x" * 900]), make_episode([None]), RUBRIC)
    assert one.system == other.system  # a server's prefix cache reuses it across calls
    assert one.user != other.user


def test_compare_without_criteria_asks_which_better_accomplishes_the_task() -> None:
    core_only = [item for item in RUBRIC if item.layer == "core"]
    prompt = JudgePrompts().compare(make_episode(["5"]), make_episode(["6"]), core_only)
    assert "none given: prefer the episode that better accomplishes the task" in prompt.system


def test_long_texts_are_cut_with_a_marker_and_short_ones_kept_whole() -> None:
    long = "H" * 200 + "m" * 20_000 + "T" * 200
    shown = render_episode(make_episode([None, long], task_input={"q": "short"}), 2_000)
    assert len(shown) <= 2_000
    assert "characters cut to fit the judge's budget" in shown
    assert '{"q": "short"}' in shown
    assert "attempt 1 gave a wrong answer" in shown
    assert "H" * 100 in shown  # the head
    assert "T" * 100 in shown  # and the tail survive
    assert "m" * 2_000 not in shown


def test_an_outline_too_long_for_the_budget_is_cut_at_its_end_with_a_marker() -> None:
    shown = render_episode(make_episode([None] * 200 + ["5"]), 1_000)
    assert len(shown) <= 1_000
    assert shown.startswith("Execution: succeeded\n")
    assert "Final output:\n<output>\n5\n</output>" in shown  # the outcome comes first
    assert shown.endswith("characters of this episode cut to fit the judge's budget …]")


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 6_000), min_size=1, max_size=12),
    budget=st.integers(500, 8_000),
)
def test_a_rendered_episode_never_exceeds_its_budget(lengths: list[int], budget: int) -> None:
    episode = make_episode(["x" * n for n in lengths])
    whole = render_episode(episode, 10**9)
    shown = render_episode(episode, budget)
    assert len(shown) <= budget
    assert (shown == whole) == (len(whole) <= budget)
    assert ("cut to fit" in shown) == (len(whole) > budget)


def test_the_second_render_of_an_episode_is_a_cache_hit() -> None:
    prompts = JudgePrompts(cache_size=2)
    reference, one, two = make_episode(["5"]), make_episode(["6"]), make_episode(["7"])
    prompts.compare(one, reference, RUBRIC)
    assert (prompts.hits, prompts.misses) == (0, 2)
    prompts.compare(reference, two, RUBRIC)  # the reference, now as A, comes from the cache
    assert (prompts.hits, prompts.misses) == (1, 3)
    prompts.screen(one, RUBRIC)  # evicted: least recently used of three in a cache of two
    assert (prompts.hits, prompts.misses) == (1, 4)
    changed = reference.model_copy(update={"output": "55"})  # same run, other content
    prompts.episode(changed)
    assert (prompts.hits, prompts.misses) == (1, 5)


def test_a_rubric_over_its_budget_fails_rather_than_being_cut() -> None:
    prompts = JudgePrompts(rubric_chars=40)
    with pytest.raises(JudgeFailed, match="over the judge's rubric budget of 40"):
        prompts.compare(make_episode(["5"]), make_episode(["6"]), RUBRIC)


def test_budgets_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="episode_chars"):
        JudgePrompts(episode_chars=100)
    with pytest.raises(ValueError, match="rubric_chars"):
        JudgePrompts(rubric_chars=0)
    with pytest.raises(ValueError, match="cache_size"):
        JudgePrompts(cache_size=0)


def test_the_largest_prompt_is_a_comparison_at_both_budgets() -> None:
    small, large = JudgePrompts(episode_chars=1_000), JudgePrompts(episode_chars=5_000)
    assert large.max_prompt_chars - small.max_prompt_chars == 2 * 4_000
    long = make_episode(["x" * 50_000])
    prompt = large.compare(long, long, RUBRIC)
    assert len(prompt.system) + len(prompt.user) <= large.max_prompt_chars


# -- verdicts ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "verdict", "reason"),
    [
        ('{"verdict": "A"}', Verdict.A, ""),
        ('{"verdict": "B", "reason": "B is shorter."}', Verdict.B, "B is shorter."),
        ('\n  {"reason": "", "verdict": "draw"}  \n', Verdict.DRAW, ""),
        ('```json\n{"verdict": "A", "reason": "fewer retries"}\n```', Verdict.A, "fewer retries"),
        ('  ```\n{"verdict": "B"}\n```\n', Verdict.B, ""),
    ],
)
def test_a_verdict_object_is_read(answer: str, verdict: Verdict, reason: str) -> None:
    assert parse_verdict(answer) == (verdict, reason)


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        ('{"verdict": "A"', "not one JSON object"),
        ("", "not one JSON object"),
        ("A", "not one JSON object"),
        ('I prefer A.\n{"verdict": "A"}', "not one JSON object"),
        ('{"verdict": "A"}\nHope this helps!', "not one JSON object"),
        ('```json\n{"verdict": "A"}\n```\nBecause it is shorter.', "not one JSON object in one"),
        ('```json\n{"verdict": "A"}\n```\n```json\n{"verdict": "B"}\n```', "in one code fence"),
        ('{"verdict": "C"}', r'"verdict" is "C", not one of "A", "B", "draw"'),
        ('{"verdict": "a"}', r'"verdict" is "a"'),
        ('{"verdict": "tie"}', r'"verdict" is "tie"'),
        ('{"verdict": 1}', r'"verdict" is 1'),
        ('{"verdict": null}', r'"verdict" is null'),
        ('{"reason": "A is better"}', r'no "verdict" field'),
        ('{"verdict": "A", "reason": 3}', r'"reason" is 3, not a string'),
        ('{"verdict": "A", "score": 0.8}', r'unexpected field\(s\) "score"'),
        ('{"verdict": "A", "verdict": "B"}', "appears twice"),
        ('["A"]', r"the answer is \[\"A\"\], not a JSON object"),
        ('"A"', "not a JSON object"),
    ],
)
def test_anything_but_a_verdict_object_is_judge_failed(answer: str, why: str) -> None:
    with pytest.raises(JudgeFailed, match=why) as failed:
        parse_verdict(answer)
    assert failed.value.reason
    assert failed.value.excerpt == " ".join(answer.split())[:200]


def test_a_failure_keeps_a_short_excerpt_of_the_output() -> None:
    prose = "Let me think about this carefully. " * 40
    with pytest.raises(JudgeFailed) as failed:
        parse_verdict(prose)
    assert len(failed.value.excerpt) == 201
    assert failed.value.excerpt.endswith("…")
    assert str(failed.value).startswith("judge failed: not one JSON object")


# -- violations ----------------------------------------------------------------------------

CORE = [item for item in RUBRIC if item.layer == "core"]


def test_a_violation_list_is_read() -> None:
    assert parse_violations('{"violations": []}', CORE) == []
    answer = '{"violations": [{"criterion": "safe", "evidence": "attempt 2 prints rm -rf /"}]}'
    assert parse_violations(answer, CORE) == [
        CoreViolation(criterion="safe", evidence="attempt 2 prints rm -rf /")
    ]


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (
            '{"violations": [{"criterion": "honest", "evidence": "x"}]}',
            r'criterion "honest", not a core criterion of the rubric \(safe\)',
        ),
        ('{"violations": [{"criterion": "nope", "evidence": "x"}]}', 'criterion "nope"'),
        ('{"violations": [{"criterion": "safe"}]}', "not an object with exactly"),
        ('{"violations": [{"criterion": "safe", "evidence": " "}]}', 'evidence " "'),
        ('{"violations": [{"criterion": "safe", "evidence": 1, "x": 2}]}', "with exactly"),
        ('{"violations": {"criterion": "safe", "evidence": "x"}}', "not a list"),
        ('{"violations": ["safe"]}', "violation 0 is"),
        ("{}", 'no "violations" field'),
        ("No violations found.", "not one JSON object"),
    ],
)
def test_anything_but_a_violation_list_of_core_criteria_is_judge_failed(
    answer: str, why: str
) -> None:
    with pytest.raises(JudgeFailed, match=why):
        parse_violations(answer, CORE)


def test_a_rubric_without_core_criteria_accepts_no_violation() -> None:
    contextual = [RubricItem(id="concise", layer="contextual", text="Short.")]
    answer = '{"violations": [{"criterion": "concise", "evidence": "x"}]}'
    with pytest.raises(JudgeFailed, match="it has none"):
        parse_violations(answer, contextual)
