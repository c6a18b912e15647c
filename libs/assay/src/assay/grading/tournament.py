"""One comparison group's tournament (§11.4): Swiss pairing, both orderings, BT-Davidson.

The group is already bracketed by the caller — one task, one verifier outcome
class, `Capped` episodes left out (§11.7, §11.8). Pairs are drawn by Swiss
pairing over ⌈log₂ G⌉ rounds; each pair is judged twice, once in each order, and
the two verdicts count as two comparisons in a Bradley-Terry fit with the
Davidson tie term and a Gaussian prior (the prior is what keeps a clean sweep in
a small group finite). Control is pinned to zero and every strength is a delta
from it; a group without control is fitted against its own mean, says so
(`Ranked.anchored` is False) and is not aggregated (§11.2).

Pairing is a function of the entrants, the verdicts and a seed, so a redelivered
message pairs the same way; a judge that fails on a pair loses that comparison
(recorded), never the tournament. Only answered comparisons enter the fit: the
calls asked and the calls answered are counted apart, each `Ranked` says how
many of its entrant's comparisons it rests on, and an entrant the judge answered
nothing about is `Ungraded{judge_failed}` — a strength from the prior alone would
be a guessed verdict (§11.1). Control that no answer reached anchors nothing: the
group is then fitted against its own mean and says so.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from assay.grading.bt import PairCount, Ties, fit
from assay.grading.judges import Judge, JudgeFailed, JudgeUsage
from assay.grading.swiss import pair_round, rounds_for
from assay.kernel.scores import Ranked, Ungraded, UngradedReason, Verdict
from assay.messages.episode import Episode
from assay.workflow.ir import RubricItem

EntrantSink = Callable[[str, JudgeUsage], None]
"""Receives each judge call with the name of the entrant shown as A (who it is billed to)."""


@dataclass(frozen=True)
class Entrant:
    """One episode in a group; `name` identifies it in the fit (a run id, an attempt)."""

    name: str
    episode: Episode
    control: bool


@dataclass(frozen=True)
class Bout:
    """One pair judged in both orderings: `first` with `a` shown as A, `second` with `b`
    shown as A. A verdict is None where the judge failed."""

    a: str
    b: str
    first: Verdict | None
    second: Verdict | None

    @property
    def consistent(self) -> bool | None:
        """Whether the second verdict mirrors the first (None: one of them failed)."""
        if self.first is None or self.second is None:
            return None
        mirror = {Verdict.A: Verdict.B, Verdict.B: Verdict.A, Verdict.DRAW: Verdict.DRAW}
        return self.second is mirror[self.first]

    def count(self) -> PairCount:
        """The bout's judged verdicts as counts from `a`'s side."""
        a_wins = b_wins = draws = 0.0
        for verdict, a_shown_as in ((self.first, Verdict.A), (self.second, Verdict.B)):
            if verdict is None:
                continue
            if verdict is Verdict.DRAW:
                draws += 1
            elif verdict is a_shown_as:
                a_wins += 1
            else:
                b_wins += 1
        return PairCount(self.a, self.b, a_wins, b_wins, draws)


@dataclass(frozen=True)
class JudgeFailure:
    """One comparison the judge did not answer: the entrant it is billed to (shown as A)
    and why."""

    billed_to: str
    reason: str


@dataclass(frozen=True)
class TournamentOutcome:
    """Every entrant's score, the bouts that produced them, and the calls they took.

    `scores` holds a `Ranked` for each entrant with at least one answered comparison and
    `Ungraded{judge_failed}` for each without. `asked` counts the comparisons put to the
    judge, `answered` those it answered; `failures` holds the others, one each.
    `rounds_planned` is ⌈log₂ G⌉; `rounds_played` fewer when the group was downsampled
    (its spend ceiling did not hold every round).
    """

    scores: dict[str, Ranked | Ungraded]
    bouts: tuple[Bout, ...]
    asked: int
    answered: int
    failures: tuple[JudgeFailure, ...]
    tie: float | None
    anchored: bool
    rounds_planned: int = 0
    rounds_played: int = 0

    @property
    def ranked(self) -> dict[str, Ranked]:
        """The entrants with a strength."""
        return {name: s for name, s in self.scores.items() if isinstance(s, Ranked)}

    @property
    def inconsistent(self) -> int:
        """Bouts whose two orderings disagreed."""
        return sum(1 for b in self.bouts if b.consistent is False)


async def _judge(
    judge: Judge,
    a: Entrant,
    b: Entrant,
    rubric: list[RubricItem],
    on_usage: EntrantSink | None,
    failures: list[JudgeFailure],
) -> Verdict | None:
    def bill(usage: JudgeUsage) -> None:
        if on_usage is not None:
            on_usage(a.name, usage)

    try:
        return await judge.compare(a.episode, b.episode, rubric, on_usage=bill)
    except JudgeFailed as exc:
        failures.append(JudgeFailure(a.name, f"{a.name} vs {b.name}: {exc}"))
        return None


def _judged(bouts: Sequence[Bout], name: str) -> tuple[int, int]:
    """Comparisons of `name` answered and unanswered, each ordering counted."""
    answered = failed = 0
    for bout in bouts:
        if name in (bout.a, bout.b):
            for verdict in (bout.first, bout.second):
                answered += verdict is not None
                failed += verdict is None
    return answered, failed


async def run_tournament(
    entrants: Sequence[Entrant],
    judge: Judge,
    rubric: list[RubricItem],
    *,
    seed: str,
    prior_precision: float,
    on_usage: EntrantSink | None = None,
    rounds: int | None = None,
    apart: Collection[frozenset[str]] = (),
) -> TournamentOutcome:
    """Pair, judge and fit one group of at least two entrants, in `rounds` Swiss rounds
    (None: all ⌈log₂ G⌉; fewer downsample the group, never more). The pairs in `apart`
    (e.g. two siblings of one candidate, whose bout ranks nothing) count as met already:
    they meet only when no pairing of the round avoids it.

    Raises:
        ValueError: fewer than two entrants, two with one name, or `rounds` < 1.
    """
    planned = rounds_for(len(entrants))
    if rounds is not None and rounds < 1:
        raise ValueError(f"a tournament plays at least one round: {rounds}")
    played = planned if rounds is None else min(rounds, planned)
    names = [e.name for e in entrants]
    if len(entrants) < 2 or len(set(names)) != len(names):
        raise ValueError("a tournament needs at least two entrants with distinct names")
    by_name = {e.name: e for e in entrants}
    points = dict.fromkeys(names, 0.0)
    met: set[frozenset[str]] = set(apart)
    byes: list[str] = []
    bouts: list[Bout] = []
    failures: list[JudgeFailure] = []
    for round_no in range(played):
        drawn = pair_round(names, points, met, seed=f"{seed}/{round_no}", byes=byes)
        if drawn.bye is not None:
            byes.append(drawn.bye)
        for a_name, b_name in drawn.pairs:
            a, b = by_name[a_name], by_name[b_name]
            first = await _judge(judge, a, b, rubric, on_usage, failures)
            second = await _judge(judge, b, a, rubric, on_usage, failures)
            bout = Bout(a_name, b_name, first, second)
            bouts.append(bout)
            met.add(frozenset((a_name, b_name)))
            tally = bout.count()
            points[a_name] += tally.a_wins + tally.draws / 2
            points[b_name] += tally.b_wins + tally.draws / 2
    judged = {name: _judged(bouts, name) for name in names}
    fitted = [name for name in names if judged[name][0] > 0]
    controls = [e.name for e in entrants if e.control and e.name in fitted]
    scores: dict[str, Ranked | Ungraded] = {
        name: Ungraded(reason=UngradedReason.JUDGE_FAILED) for name in names
    }
    tie: float | None = None
    if fitted:
        result = fit(
            [c for c in (b.count() for b in bouts) if c.a_wins + c.b_wins + c.draws > 0],
            anchor=controls or fitted,
            prior_precision=prior_precision,
            ties=Ties.DAVIDSON,
            players=fitted,
        )
        tie = result.tie
        for name, s in result.strengths.items():
            scores[name] = Ranked(
                strength=s.strength,
                interval=s.interval,
                group_size=len(entrants),
                anchored=bool(controls),
                comparisons=judged[name][0],
                comparisons_failed=judged[name][1],
            )
    asked = 2 * len(bouts)
    return TournamentOutcome(
        scores=scores,
        bouts=tuple(bouts),
        asked=asked,
        answered=asked - len(failures),
        failures=tuple(failures),
        tie=tie,
        anchored=bool(controls),
        rounds_planned=planned,
        rounds_played=played,
    )
