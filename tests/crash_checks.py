"""What a crash at a named point may and may not leave behind (§8.3, §8.4, §9.4).

The crash-point tests take two views of the execute stage's log — as the
killed process left it, and after the restarted one finished — and the
effect sink, and hand them to `check_recovery`. The log at the crash is the
ground truth §8.4 classifies from: the last committed intent state of every
open attempt says which window the crash fell in, and so how it must be
resolved. The sink is the outside world's independent account of effects.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

RESOLVED_BY_RETRY = "retried under the same idempotency key"

UNSAFE_WINDOW = frozenset(
    {
        "execute.after_commit.Intent.dispatched.unsafe",
        "execute.tool.sink_charge.before_effect",
        "execute.tool.sink_charge.after_effect",
        "execute.before_commit.Intent.committed.unsafe+AttemptFinished.succeeded",
    }
)
"""The crash falls after `Dispatched` of an Unsafe call and before its `Committed`."""

IDEMPOTENT_WINDOW = frozenset(
    {
        "execute.after_commit.Intent.dispatched.idempotent",
        "execute.tool.sink_put.before_effect",
        "execute.tool.sink_put.after_effect",
        "execute.before_commit.Intent.committed.idempotent+AttemptFinished.succeeded",
    }
)
"""The same window of an Idempotent call."""

PENDING_WINDOW = frozenset(
    {
        "execute.after_commit.Intent.pending.idempotent",
        "execute.before_commit.Intent.dispatched.idempotent",
        "execute.after_commit.Intent.pending.unsafe",
        "execute.before_commit.Intent.dispatched.unsafe",
    }
)
"""Window A: `Pending` is the last committed state; the call was never issued."""

PURE_WINDOW = frozenset(
    {
        "execute.tool.sink_price.during",
        "execute.before_commit.AttemptStarted+AttemptFinished.succeeded",
    }
)
"""Inside a Pure step, before its only commit (start and end together): nothing of the
attempt is on record, and recovery runs it again as the same attempt."""

IN_HANDLER = frozenset(
    {
        "execute.after_claim",
        "execute.before_commit.RunStarted",
        "execute.after_commit.RunStarted",
        "execute.before_commit.AttemptStarted",
        "execute.after_commit.AttemptStarted",
        "execute.after_commit.AttemptStarted+AttemptFinished.succeeded",
        "execute.before_commit.Intent.pending.idempotent",
        "execute.before_commit.Intent.pending.unsafe",
        "execute.after_commit.Intent.committed.idempotent+AttemptFinished.succeeded",
        "execute.after_commit.Intent.committed.unsafe+AttemptFinished.succeeded",
        "execute.before_final_commit",
        *PURE_WINDOW,
        *UNSAFE_WINDOW,
        *IDEMPOTENT_WINDOW,
        *PENDING_WINDOW,
    }
)
"""Points a run's handler reaches before its last commit: that run is in flight."""

RELAY = ("execute.relay.after_drain", "execute.relay.after_publish", "execute.relay.after_ack")

POINTS = [*sorted(IN_HANDLER), "execute.after_final_commit", *RELAY]
"""Every crash point of the execute stage and its relay that the tests exercise."""


@dataclass(frozen=True)
class Rec:
    """One record of the execute log."""

    stream: str
    lsn: int
    type: str
    at_ms: int
    doc: dict[str, Any]


@dataclass
class ExecuteLog:
    """One tenant's execute log, and the runs that have a lease row."""

    records: list[Rec]
    leased: set[str] = field(default_factory=set)

    @classmethod
    def from_rows(cls, rows: list[tuple[Any, ...]], leased: set[str]) -> ExecuteLog:
        """From (stream, lsn, type, at_ms, payload) rows, in any order."""
        recs = [Rec(str(s), int(lsn), str(t), int(at), json.loads(p)) for s, lsn, t, at, p in rows]
        return cls(sorted(recs, key=lambda r: (r.stream, r.lsn)), leased)

    def runs(self) -> dict[str, list[Rec]]:
        """Records by run, in LSN order."""
        out: dict[str, list[Rec]] = defaultdict(list)
        for r in self.records:
            out[r.stream].append(r)
        return out

    def finished(self) -> set[str]:
        """Runs with a `RunFinished`."""
        return {r.stream for r in self.records if r.type == "RunFinished"}


Attempt = tuple[str, str, int]
"""(run, step, attempt)."""


def _attempt(r: Rec) -> Attempt:
    return (r.stream, r.doc["step"], int(r.doc["attempt"]))


def _open_attempts(log: ExecuteLog) -> dict[Attempt, dict[str, Any] | None]:
    """Attempts started and not finished -> their last committed intent (or None)."""
    started = {_attempt(r) for r in log.records if r.type == "AttemptStarted"}
    closed = {_attempt(r) for r in log.records if r.type == "AttemptFinished"}
    last: dict[Attempt, dict[str, Any] | None] = dict.fromkeys(started - closed)
    for r in log.records:
        if r.type == "Intent" and _attempt(r) in last:
            last[_attempt(r)] = r.doc
    return last


def _one(recs: list[Rec], type_: str, at: Attempt, **match: Any) -> list[Rec]:
    return [
        r
        for r in recs
        if r.type == type_
        and _attempt(r) == at
        and all(r.doc.get(k) == v for k, v in match.items())
    ]


def check_recovery(
    point: str,
    at_crash: ExecuteLog,
    final: ExecuteLog,
    sink: list[dict[str, Any]],
    *,
    tenant: str,
    runs_expected: int,
    restarted_ms: int,
    ttl_s: float,
) -> None:
    """Assert that the restart recovered the crash as §8.3, §8.4 and §9.4 require.

    - nothing committed before the crash was lost or rewritten, and every run
      finished exactly once; no attempt was started or finished twice;
    - a crash inside a Pure step left nothing of its attempt on record, and the restart
      ran it again as that same attempt (not closed as interrupted, not attempt 2);
    - every attempt open at the crash was resolved by its last committed intent:
      none or `Pending` -> closed as interrupted and retried; `Dispatched` of an
      Idempotent call -> retried under the same key and committed; `Dispatched`
      of an Unsafe call -> `Indeterminate`, never retried. No other attempt is
      `Indeterminate`;
    - the sink shows each idempotency key's effect exactly once (one per run),
      and each Unsafe call at most once;
    - every run in flight at the crash made progress within TTL + RESUME_SLACK_S of the
      restarted stage coming up at `restarted_ms` (its dead worker's lease
      lapsed, and nothing else — a consumer group, a poll — held it up longer).
    """
    runs = final.runs()
    assert len(runs) == runs_expected, f"{len(runs)} runs, expected {runs_expected}"
    for run, recs in runs.items():
        kinds = Counter(r.type for r in recs)
        assert kinds["RunStarted"] == 1, (run, kinds)
        assert kinds["RunFinished"] == 1, (run, kinds)
        assert [r.lsn for r in recs] == list(range(len(recs))), f"{run}: LSN gap"
        once = Counter(
            (r.type, *_attempt(r)[1:])
            for r in recs
            if r.type in ("AttemptStarted", "AttemptFinished")
        )
        assert max(once.values()) == 1, f"{run}: an attempt recorded twice: {once}"
    for run, before in at_crash.runs().items():
        after = runs[run][: len(before)]
        assert [(r.lsn, r.type, r.doc) for r in after] == [
            (r.lsn, r.type, r.doc) for r in before
        ], f"{run}: a record committed before the crash was lost or changed"

    # §8.4: the last committed intent state classifies every open attempt.
    open_at_crash = _open_attempts(at_crash)
    indeterminate_expected: set[Attempt] = set()
    window: Counter[str] = Counter()
    recs = final.records
    for at, intent in open_at_crash.items():
        (finished,) = _one(recs, "AttemptFinished", at)
        run, step, n = at
        if intent is None or intent["state"] == "pending":
            window["pending" if intent else "no intent"] += 1
            assert finished.doc["interrupted"], at
            assert finished.doc["state"] == "failed", at
            assert _one(recs, "AttemptStarted", (run, step, n + 1)), f"{at} was not retried"
        elif intent["state"] == "dispatched" and intent["effect"] == "unsafe":
            window["dispatched unsafe"] += 1
            indeterminate_expected.add(at)
            assert finished.doc["state"] == "indeterminate", at
            assert not _one(recs, "AttemptStarted", (run, step, n + 1)), f"{at} was retried"
        elif intent["state"] == "dispatched":
            assert intent["effect"] == "idempotent", intent
            window["dispatched idempotent"] += 1
            (committed,) = _one(recs, "Intent", at, state="committed")
            assert committed.doc["resolved_by"] == RESOLVED_BY_RETRY, committed.doc
            assert committed.doc["idempotency_key"] == intent["idempotency_key"]
            assert finished.doc["state"] == "succeeded", at
        else:
            window["committed"] += 1
            assert finished.doc["state"] == "succeeded", at
            assert not finished.doc["interrupted"], at
    indeterminate = {
        _attempt(r)
        for r in recs
        if r.type == "AttemptFinished" and r.doc["state"] == "indeterminate"
    }
    assert indeterminate == indeterminate_expected, (
        f"Indeterminate {sorted(indeterminate)}, but §8.4 says {sorted(indeterminate_expected)}"
    )
    if point in UNSAFE_WINDOW:
        assert window["dispatched unsafe"] >= 1, f"{point}: no Unsafe call was in window B"
    if point in IDEMPOTENT_WINDOW:
        assert window["dispatched idempotent"] >= 1, f"{point}: no Idempotent call in window B"
    if point in PENDING_WINDOW:
        assert window["pending"] >= 1, f"{point}: no call was in window A"

    if point in PURE_WINDOW:
        _check_pure_rerun(point, at_crash, final)
    _check_effects(point, final, sink, tenant, indeterminate)
    _check_resumed(point, at_crash, final, restarted_ms, ttl_s)


def _check_pure_rerun(point: str, at_crash: ExecuteLog, final: ExecuteLog) -> None:
    """Some run died inside its Pure `price` step: none of that attempt was committed, and
    the restart ran attempt 1 again to success (nothing to close, nothing interrupted)."""
    recorded = {_attempt(r)[:2] for r in at_crash.records if r.type == "AttemptStarted"}
    unrecorded = [
        run
        for run in at_crash.runs()
        if (run, "price") not in recorded and run not in at_crash.finished()
    ]
    assert unrecorded, f"{point}: no run was inside its Pure step"
    for run in unrecorded:
        ends = [r.doc for r in final.runs()[run] if r.type == "AttemptFinished"]
        price = [(d["attempt"], d["state"], d["interrupted"]) for d in ends if d["step"] == "price"]
        assert price == [(1, "succeeded", False)], f"{run}: price attempts {price}"


def _check_effects(
    point: str,
    final: ExecuteLog,
    sink: list[dict[str, Any]],
    tenant: str,
    indeterminate: set[Attempt],
) -> None:
    mine = [e for e in sink if e["tenant"] == tenant]
    keys = {
        r.doc["idempotency_key"]
        for r in final.records
        if r.type == "Intent" and r.doc["effect"] == "idempotent"
    }
    assert len(keys) == len(final.runs()), "one idempotency key per run"
    puts = [e for e in mine if e["tool"] == "sink_put"]
    assert {e["key"] for e in puts} == keys, "a put under a key the log does not know, or none"
    applied = Counter(e["key"] for e in puts if e["applied"])
    assert all(applied[k] == 1 for k in keys), f"an effect applied twice or never: {applied}"
    charges = Counter(e["run"] for e in mine if e["tool"] == "sink_charge")
    assert all(n == 1 for n in charges.values()), f"an Unsafe call landed twice: {charges}"
    undecided = {run for run, _, _ in indeterminate}
    for run in final.runs():
        if run not in undecided:
            assert charges[run] == 1, f"{run}: charged {charges[run]} times"
    if point == "execute.tool.sink_charge.after_effect":
        assert any(charges[run] == 1 for run in undecided), "the landed charge is not on record"
    if point == "execute.tool.sink_charge.before_effect":
        assert any(charges[run] == 0 for run in undecided), "an undispatched charge landed"


RESUME_SLACK_S = 5.0
"""How long after its lease expires a restarted stage may take to resume a run: rejoining
the consumer group and the first poll, on two loaded cores (2.6 s seen), well short of
anything that waits for a timeout instead of the lease."""


def _check_resumed(
    point: str, at_crash: ExecuteLog, final: ExecuteLog, restarted_ms: int, ttl_s: float
) -> None:
    before = at_crash.runs()
    in_flight = (at_crash.leased | set(before)) - at_crash.finished()
    if point in IN_HANDLER:
        assert in_flight, f"{point}: no run was in flight at the crash"
    bound_ms = int((ttl_s + RESUME_SLACK_S) * 1000)
    for run, recs in final.runs().items():
        if run not in in_flight:
            continue
        done = len(before.get(run, []))
        first = recs[done]  # the first record the restarted process wrote for the run
        late = first.at_ms - restarted_ms
        assert late <= bound_ms, (
            f"{run} resumed {late} ms after the restart "
            f"(bound: lease TTL + {RESUME_SLACK_S:.0f} s = {bound_ms} ms)"
        )
