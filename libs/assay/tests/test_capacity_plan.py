"""What the declared capacity implies (§14.2): the judge's prompt budget and the
retention target follow from the derived ceiling; `assay capacity` prints them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from assay.cli import main
from assay.grading.chat_judge import CHARS_PER_TOKEN, episode_chars_within
from assay.runtime.capacity_plan import plan_capacity
from assay.runtime.settings import AssaySettings

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "capacity" / "llama-3.1-8b-1xh100.yaml"
L8B = "meta-llama/Llama-3.1-8B-Instruct"
AGENT = {"ASSAY_MODEL_URL": "http://127.0.0.1:1/v1", "ASSAY_MODEL_NAME": L8B}


def test_a_small_device_cuts_the_judge_budget_and_the_retention_target() -> None:
    # 20 GB on one device: (20e9 - 16.06e9) / 131,072 = 30,059 tokens for a judge call
    settings = AssaySettings.from_env(
        {
            **AGENT,
            "ASSAY_CAPACITY_FILE": str(EXAMPLE),
            "ASSAY_CAPACITY_VRAM_BYTES_PER_DEVICE": "20GB",
        }
    )
    plan = plan_capacity(settings)
    assert plan is not None
    assert plan.judge_context_tokens == (20 * 10**9 - 16_060_000_000) // 131_072 == 30_059
    assert plan.retention_target_tokens == 15_029
    assert plan.retention(settings.retention).token_ceiling == 15_029  # configured 200k: bound wins
    chars = episode_chars_within(30_059)
    assert plan.judge_episode_chars == min(settings.judge.episode_chars, chars)
    assert chars * 2 / CHARS_PER_TOKEN < 30_059


def test_the_retention_target_is_half_the_ceiling_and_only_lowers() -> None:
    settings = AssaySettings.from_env({**AGENT, "ASSAY_CAPACITY_FILE": str(EXAMPLE)})
    plan = plan_capacity(settings)
    assert plan is not None
    # (72e9 - 16.06e9) / 131,072 = 426,788; half is 213,394 > the configured 200,000
    assert (plan.judge_context_tokens, plan.retention_target_tokens) == (426_788, 213_394)
    assert plan.retention(settings.retention).token_ceiling == 200_000


def test_assay_capacity_prints_the_derived_numbers(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for k, v in {**AGENT, "ASSAY_CAPACITY_FILE": str(EXAMPLE)}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as done:
        main(["capacity", "--json"])
    assert done.value.code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["resident"][0]["max_context_tokens"] == 426_788
    assert doc["retention_effective_tokens"] == 200_000
    with pytest.raises(SystemExit):
        main(["capacity"])
    assert "max_context_tokens 426788" in capsys.readouterr().out
