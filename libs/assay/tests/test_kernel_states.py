"""The kernel's closed state machines (§5.1, §5.2), identifiers, canonical hashing, WinRecord."""

from __future__ import annotations

import itertools
import math
import random
import re
import time
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from assay.kernel import (
    AttemptState,
    IllegalTransition,
    IntentState,
    RunState,
    attempt_transition,
    canonical_bytes,
    content_hash,
    digest,
    intent_transition,
    is_run_id,
    legal_attempt_transitions,
    legal_intent_transitions,
    legal_run_transitions,
    new_run_id,
    run_id_from,
    run_transition,
    tenant_id,
)
from assay.kernel.scores import DecidedBy, Outcome, WinRecord

A = AttemptState
R = RunState

# §5.1, written out arm for arm: (from, to) -> the values of `intent_dispatched` it is legal with.
ATTEMPT_TABLE: dict[tuple[AttemptState, AttemptState], frozenset[bool]] = {
    (A.PENDING, A.RUNNING): frozenset({False, True}),
    (A.PENDING, A.CANCELLED): frozenset({False, True}),
    (A.PENDING, A.TIMED_OUT): frozenset({False, True}),
    (A.RUNNING, A.SUCCEEDED): frozenset({False, True}),
    (A.RUNNING, A.FAILED): frozenset({False, True}),
    (A.RUNNING, A.TIMED_OUT): frozenset({False, True}),
    (A.RUNNING, A.CANCELLED): frozenset({False}),
    (A.RUNNING, A.INDETERMINATE): frozenset({True}),
}

# §5.2, written out edge for edge.
RUN_TABLE: frozenset[tuple[RunState, RunState]] = frozenset(
    {
        (R.SCHEDULED, R.RUNNING),
        (R.RUNNING, R.SUSPENDED),
        (R.SUSPENDED, R.RUNNING),
        (R.RUNNING, R.VERIFYING),
        (R.VERIFYING, R.VERIFIED_PASS),
        (R.VERIFYING, R.VERIFIED_FAIL),
        (R.VERIFIED_PASS, R.GRADING),
        (R.VERIFIED_FAIL, R.GRADING),
        (R.GRADING, R.GRADED),
        (R.GRADING, R.UNGRADED),
        (R.GRADED, R.ARCHIVED),
        (R.UNGRADED, R.ARCHIVED),
        (R.SCHEDULED, R.CANCELLED),
        (R.RUNNING, R.CANCELLED),
        (R.SUSPENDED, R.CANCELLED),
        (R.VERIFYING, R.CANCELLED),
        (R.VERIFIED_PASS, R.CANCELLED),
        (R.VERIFIED_FAIL, R.CANCELLED),
        (R.GRADING, R.CANCELLED),
    }
)
RUN_TERMINAL = frozenset({R.GRADED, R.UNGRADED, R.ARCHIVED, R.CANCELLED})

ALL_ATTEMPT_PAIRS = list(itertools.product(AttemptState, AttemptState, [False, True]))
ALL_RUN_PAIRS = list(itertools.product(RunState, RunState))
CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


# --- attempts (§5.1) ---------------------------------------------------------------------------


def test_attempt_states_are_exactly_the_seven_of_the_closed_machine() -> None:
    assert {s.name for s in AttemptState} == {
        "PENDING",
        "RUNNING",
        "SUCCEEDED",
        "FAILED",
        "INDETERMINATE",
        "CANCELLED",
        "TIMED_OUT",
    }


@pytest.mark.parametrize(("frm", "to", "intent_dispatched"), ALL_ATTEMPT_PAIRS)
def test_attempt_transition_matches_the_normative_table_for_every_pair(
    frm: AttemptState, to: AttemptState, intent_dispatched: bool
) -> None:
    if intent_dispatched in ATTEMPT_TABLE.get((frm, to), frozenset()):
        assert attempt_transition(frm, to, intent_dispatched=intent_dispatched) is to
    else:
        with pytest.raises(IllegalTransition) as info:
            attempt_transition(frm, to, intent_dispatched=intent_dispatched)
        assert info.value.frm is frm
        assert info.value.to is to
        assert f"{frm} -> {to}" in str(info.value)


def test_legal_attempt_transitions_equals_the_written_out_table() -> None:
    assert legal_attempt_transitions() == frozenset(ATTEMPT_TABLE)


def test_attempt_transition_defaults_to_no_dispatched_intent() -> None:
    assert attempt_transition(A.RUNNING, A.CANCELLED) is A.CANCELLED
    with pytest.raises(IllegalTransition, match="no intent was dispatched"):
        attempt_transition(A.RUNNING, A.INDETERMINATE)


def test_cancelling_a_running_attempt_with_a_dispatched_intent_says_indeterminate() -> None:
    with pytest.raises(IllegalTransition, match="Indeterminate"):
        attempt_transition(A.RUNNING, A.CANCELLED, intent_dispatched=True)


def test_nothing_leaves_a_terminal_attempt_state() -> None:
    terminal = {s for s in AttemptState if s.terminal}
    assert terminal == set(AttemptState) - {A.PENDING, A.RUNNING}
    for frm, to in itertools.product(terminal, AttemptState):
        assert (frm, to) not in legal_attempt_transitions()


# --- run lifecycle (§5.2) ----------------------------------------------------------------------


@pytest.mark.parametrize(("frm", "to"), ALL_RUN_PAIRS)
def test_run_transition_matches_the_lifecycle_for_every_pair(frm: RunState, to: RunState) -> None:
    if (frm, to) in RUN_TABLE:
        assert run_transition(frm, to) is to
    else:
        with pytest.raises(IllegalTransition) as info:
            run_transition(frm, to)
        assert info.value.frm is frm
        assert info.value.to is to


def test_legal_run_transitions_equals_the_written_out_lifecycle() -> None:
    assert legal_run_transitions() == RUN_TABLE


def test_cancel_is_reachable_from_every_non_terminal_run_state_and_no_terminal_one() -> None:
    for state in RunState:
        assert ((state, R.CANCELLED) in RUN_TABLE) == (state not in RUN_TERMINAL)
        assert state.cancellable == (state not in RUN_TERMINAL)


def test_nothing_leaves_a_terminal_run_state_except_graded_and_ungraded_to_archived() -> None:
    leaving = {(f, t) for (f, t) in legal_run_transitions() if f in RUN_TERMINAL}
    assert leaving == {(R.GRADED, R.ARCHIVED), (R.UNGRADED, R.ARCHIVED)}


def test_grading_ended_holds_for_graded_ungraded_and_archived_only() -> None:
    assert {s for s in RunState if s.grading_ended} == {R.GRADED, R.UNGRADED, R.ARCHIVED}


def test_the_happy_path_walks_from_scheduled_to_archived() -> None:
    path = [
        R.SCHEDULED,
        R.RUNNING,
        R.SUSPENDED,
        R.RUNNING,
        R.VERIFYING,
        R.VERIFIED_FAIL,
        R.GRADING,
        R.UNGRADED,
        R.ARCHIVED,
    ]
    state = path[0]
    for nxt in path[1:]:
        state = run_transition(state, nxt)
    assert state is R.ARCHIVED


def test_verifying_cannot_be_skipped_and_grading_cannot_be_skipped() -> None:
    for frm, to in [
        (R.RUNNING, R.VERIFIED_PASS),
        (R.RUNNING, R.GRADING),
        (R.VERIFYING, R.GRADING),
        (R.VERIFIED_PASS, R.GRADED),
        (R.SUSPENDED, R.VERIFYING),
    ]:
        with pytest.raises(IllegalTransition, match="illegal run transition"):
            run_transition(frm, to)


# --- identifiers (§3) --------------------------------------------------------------------------


def _ulid_ms(run_id: str) -> int:
    """The timestamp a ULID encodes (its first 10 Crockford characters)."""
    value = 0
    for c in run_id[:10]:
        value = value * 32 + CROCKFORD.index(c)
    return value


def test_new_run_id_is_a_26_character_crockford_ulid() -> None:
    rid = new_run_id()
    assert len(rid) == 26
    assert set(rid) <= set(CROCKFORD)
    assert is_run_id(rid)


@settings(max_examples=100)
@given(
    st.integers(min_value=0, max_value=(1 << 48) - 2),
    st.integers(min_value=1, max_value=1 << 20),
    st.binary(min_size=10, max_size=10),
    st.binary(min_size=10, max_size=10),
)
def test_run_ids_sort_by_creation_time_whatever_the_entropy(
    ms: int, later_by: int, entropy_a: bytes, entropy_b: bytes
) -> None:
    later = min(ms + later_by, (1 << 48) - 1)
    first = new_run_id(ms, entropy_a)
    second = new_run_id(later, entropy_b)
    assert is_run_id(first)
    assert is_run_id(second)
    assert first < second
    assert _ulid_ms(first) == ms
    assert _ulid_ms(second) == later


def test_new_run_id_without_a_time_encodes_now() -> None:
    before = int(time.time() * 1000)
    rid = new_run_id()
    after = int(time.time() * 1000)
    assert before <= _ulid_ms(rid) <= after


def test_new_run_id_refuses_short_entropy() -> None:
    with pytest.raises(ValueError, match="10 bytes"):
        new_run_id(0, b"short")


@settings(max_examples=50)
@given(st.integers(min_value=0, max_value=(1 << 48) - 1), st.text(), st.text())
def test_run_id_from_is_deterministic_and_seed_dependent(ms: int, seed: str, other: str) -> None:
    rid = run_id_from(ms, seed)
    assert rid == run_id_from(ms, seed)
    assert is_run_id(rid)
    assert _ulid_ms(rid) == ms
    if other != seed:
        assert run_id_from(ms, other) != rid


@pytest.mark.parametrize(
    "value",
    [
        "",
        "01ARZ3NDEKTSV4RRFFQ69G5FA",  # 25 characters
        "01ARZ3NDEKTSV4RRFFQ69G5FAVX",  # 27 characters
        "01arz3ndektsv4rrffq69g5fav",  # lower case
        "01ARZ3NDEKTSV4RRFFQ69G5FAU",  # U is not Crockford
        "01ARZ3NDEKTSV4RRFFQ69G5FAI",  # I is not Crockford
        "81ARZ3NDEKTSV4RRFFQ69G5FAV",  # beyond 48 bits of time
    ],
)
def test_is_run_id_rejects_malformed_values(value: str) -> None:
    assert not is_run_id(value)


def test_is_run_id_accepts_a_known_ulid() -> None:
    assert is_run_id("01ARZ3NDEKTSV4RRFFQ69G5FAV")


def test_tenant_id_parses_uuid_strings_and_uuids() -> None:
    raw = uuid.uuid4()
    assert tenant_id(str(raw)) == raw
    assert tenant_id(raw) == raw
    assert isinstance(tenant_id(str(raw)), uuid.UUID)


@pytest.mark.parametrize("value", ["", "tenant-1", "acme", "1234", "not-a-uuid-at-all-0000000"])
def test_tenant_id_rejects_non_uuids_with_value_error(value: str) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - uuid.UUID's message varies by version
        tenant_id(value)


# --- canonical form ----------------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=100)
@given(st.dictionaries(st.text(), json_values, max_size=6), st.randoms())
def test_canonical_bytes_do_not_depend_on_key_order(
    doc: dict[str, object], rnd: random.Random
) -> None:
    def shuffled(value: object) -> object:
        if isinstance(value, dict):
            items = list(value.items())
            rnd.shuffle(items)
            return {k: shuffled(v) for k, v in items}
        if isinstance(value, list):
            return [shuffled(v) for v in value]
        return value

    other = shuffled(doc)
    assert canonical_bytes(other) == canonical_bytes(doc)
    assert content_hash(other) == content_hash(doc)


def test_canonical_bytes_are_compact_sorted_utf8() -> None:
    assert canonical_bytes({"b": 1, "a": [1, 2], "é": "ü"}) == '{"a":[1,2],"b":1,"é":"ü"}'.encode()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_canonical_bytes_reject_nan_and_infinity(bad: float) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - json's message is not ours
        canonical_bytes({"x": [bad]})


def test_content_hash_is_64_lowercase_hex_of_the_canonical_bytes() -> None:
    h = content_hash({"a": 1})
    assert re.fullmatch(r"[0-9a-f]{64}", h)
    assert h == digest(canonical_bytes({"a": 1}))
    assert h != content_hash({"a": 2})


# --- WinRecord (§11.3) -------------------------------------------------------------------------


def test_win_record_starts_empty() -> None:
    rec = WinRecord()
    assert (rec.wins, rec.losses, rec.comparisons) == (0, 0, 0)


@pytest.mark.parametrize(
    ("outcome", "decided_by", "field"),
    [
        (Outcome.WIN, DecidedBy.JUDGE, "judge_wins"),
        (Outcome.LOSS, DecidedBy.JUDGE, "judge_losses"),
        (Outcome.WIN, DecidedBy.VERIFIER, "verifier_wins"),
        (Outcome.LOSS, DecidedBy.VERIFIER, "verifier_losses"),
        (Outcome.DRAW, DecidedBy.JUDGE, "draws"),
        (Outcome.DRAW, DecidedBy.VERIFIER, "draws"),
    ],
)
def test_win_record_add_counts_exactly_one_field(
    outcome: Outcome, decided_by: DecidedBy, field: str
) -> None:
    before = WinRecord(judge_wins=1, judge_losses=2, draws=3, verifier_wins=4, verifier_losses=5)
    after = before.add(outcome, decided_by)
    changed = {
        name: (getattr(before, name), getattr(after, name))
        for name in WinRecord.model_fields
        if getattr(before, name) != getattr(after, name)
    }
    assert changed == {field: (getattr(before, field), getattr(before, field) + 1)}
    assert after.capped == before.capped


def test_win_record_add_returns_a_new_record_and_leaves_the_old_one() -> None:
    rec = WinRecord()
    rec.add(Outcome.WIN, DecidedBy.JUDGE)
    assert rec == WinRecord()


@settings(max_examples=100)
@given(st.lists(st.tuples(st.sampled_from(Outcome), st.sampled_from(DecidedBy)), max_size=40))
def test_win_record_keeps_judge_and_verifier_apart_and_draws_out_of_wins_and_losses(
    history: list[tuple[Outcome, DecidedBy]],
) -> None:
    rec = WinRecord()
    for outcome, by in history:
        rec = rec.add(outcome, by)

    def count(o: Outcome, by: DecidedBy | None = None) -> int:
        return sum(1 for oo, bb in history if oo is o and (by is None or bb is by))

    assert rec.judge_wins == count(Outcome.WIN, DecidedBy.JUDGE)
    assert rec.verifier_wins == count(Outcome.WIN, DecidedBy.VERIFIER)
    assert rec.judge_losses == count(Outcome.LOSS, DecidedBy.JUDGE)
    assert rec.verifier_losses == count(Outcome.LOSS, DecidedBy.VERIFIER)
    assert rec.draws == count(Outcome.DRAW)
    assert rec.wins == count(Outcome.WIN)
    assert rec.losses == count(Outcome.LOSS)
    assert rec.comparisons == len(history)
    assert rec.capped == 0


# §8.4, written out: the intent of a tool call with an effect.
INTENT_TABLE: frozenset[tuple[IntentState | None, IntentState]] = frozenset(
    {
        (None, IntentState.PENDING),
        (IntentState.PENDING, IntentState.DISPATCHED),
        (IntentState.DISPATCHED, IntentState.COMMITTED),
    }
)


def test_intent_transitions_follow_the_written_out_table_pair_by_pair() -> None:
    assert legal_intent_transitions() == INTENT_TABLE
    for frm, to in itertools.product([None, *IntentState], IntentState):
        if (frm, to) in INTENT_TABLE:
            assert intent_transition(frm, to) is to
        else:
            with pytest.raises(IllegalTransition):
                intent_transition(frm, to)
