"""Retention's measure, its reduction of an episode, and its archive format (§8.6)."""

from __future__ import annotations

import uuid

from hypothesis import given
from hypothesis import strategies as st

from assay.engine import WORK_EVENTS
from assay.engine.events import CancelRequested, GradingEnded, RunStarted
from assay.engine.retention import (
    decode_archive,
    elide,
    encode_archive,
    episode_tokens,
    reduce_episode,
)
from assay.kernel import AttemptNo, AttemptState, BranchId, Lsn, StepId, TaskId, tenant_id
from assay.messages import AttemptView, Episode, Purpose, Role, RunRef, Usage
from assay.record import BranchKey, LogRecord

TENANT = tenant_id(uuid.UUID(int=3))
REF = RunRef(
    tenant=TENANT,
    run_id="01J8Z3K6QY7R2M4T9V5X1B3N8C",
    task_id=TaskId("t"),
    idempotency_key="k",
    workflow_id="wf",
    workflow_version="v",
    role=Role.CURRENT,
    purpose=Purpose.WORK,
)


def episode(text: str) -> Episode:
    attempt = AttemptView(
        step=StepId("s"),
        attempt=AttemptNo(1),
        iteration=0,
        state=AttemptState.SUCCEEDED,
        prompt=text,
        output=text[::-1],
        usage=Usage(model_calls=1, prompt_tokens=7, completion_tokens=3),
        duration_ms=5,
    )
    return Episode(
        run=REF,
        definition={"id": "wf", "steps": [{"id": "s", "kind": "model", "prompt": "p"}]},
        input={"q": text, "n": 3, "more": [text, {"deep": text}]},
        attempts=[attempt],
        outputs={"s": text[::-1]},
        output=text,
        succeeded=True,
        usage=Usage(model_calls=1, prompt_tokens=7, completion_tokens=3),
    )


@given(st.text(max_size=300), st.integers(min_value=0, max_value=120))
def test_elide_keeps_head_and_tail_and_says_how_much_is_gone(text: str, keep: int) -> None:
    short, gone = elide(text, keep)
    if gone == 0:  # short enough, or not worth a marker
        assert short == text
        assert len(text) <= keep + len(f"\n…[{len(text) - keep} characters elided]…\n")
        return
    assert len(short) < len(text)
    head = keep * 3 // 4
    assert gone == len(text) - keep
    assert short.startswith(text[:head])
    assert short.endswith(text[len(text) - (keep - head) :])
    assert f"…[{gone} characters elided]…" in short


def test_the_measure_is_characters_over_four_of_the_texts_reduction_can_shorten() -> None:
    # input: q, more[0], more[1].deep; the attempt's prompt and output; outputs.s; output.
    assert episode_tokens(episode("abcd" * 10)) == 7 * 40 // 4
    assert episode_tokens(episode("")) == 0


@given(st.text(min_size=0, max_size=400), st.integers(min_value=0, max_value=100))
def test_reduction_keeps_every_transition_and_is_deterministic(text: str, keep: int) -> None:
    whole = episode(text)
    summary = reduce_episode(whole, "ab" * 32, keep)
    assert summary.encode() == reduce_episode(whole, "ab" * 32, keep).encode()
    short = summary.episode
    assert short.model_dump(exclude={"input", "attempts", "outputs", "output"}) == (
        whole.model_dump(exclude={"input", "attempts", "outputs", "output"})
    )
    assert [a.model_dump(exclude={"prompt", "output", "error"}) for a in short.attempts] == [
        a.model_dump(exclude={"prompt", "output", "error"}) for a in whole.attempts
    ]
    assert short.input["n"] == 3
    assert summary.tokens_before == episode_tokens(whole)
    assert summary.tokens_after == episode_tokens(short) <= summary.tokens_before
    assert len(summary.elisions) == (7 if elide(text, keep)[1] else 0)
    assert all(e.elided == e.chars - keep for e in summary.elisions)


def test_an_archive_decodes_to_exactly_the_records_it_was_made_of() -> None:
    run = BranchKey(TENANT, REF.run_id, BranchId(0))
    commands = BranchKey(TENANT, f"{REF.run_id}/commands", BranchId(0))
    records = [
        LogRecord(run, Lsn(0), 1, 1_700_000_000_000, RunStarted(run=REF)),
        LogRecord(run, Lsn(1), 1, 1_700_000_000_500, GradingEnded(status="graded")),
        LogRecord(commands, Lsn(0), 1, 1_700_000_000_100, CancelRequested(reason="ünï")),
    ]
    data = encode_archive(records)
    assert data.count(b"\n") == 3
    assert decode_archive(data, WORK_EVENTS) == records
    assert encode_archive(decode_archive(data, WORK_EVENTS)) == data
