"""`assay grade bt|sprt`: the grading statistics (§11.3, §11.4) on the command line.

`bt` fits Bradley–Terry–Davidson strengths to a CSV of comparisons and prints
each as a delta from the anchor; `sprt` shows what the sequential test costs
at a given true win rate, beside the fixed-sample test with the same α and β.
Both print JSON on stdout; bad input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from pathlib import Path

from pydantic import ValidationError

from assay.grading.bt import PairCount, Ties, count_rows, fit
from assay.grading.sprt import SprtPolicy, fixed_n, operating_characteristics, simulate
from assay.kernel.errors import AssayError
from assay.kernel.schema import one_line

ROWS_HEADER = ["a", "b", "winner"]
COUNTS_HEADER = ["a", "b", "a_wins", "b_wins", "draws"]


def bt_command(
    source: str,
    *,
    anchors: list[str] | None,
    prior_precision: float,
    ties: str,
    level: float,
) -> int:
    """Fit and print `{name: {"strength", "se", "interval"}}`; the tie parameter goes to stderr.

    Raises:
        AssayError: the input cannot be read or parsed (with its line), or the fit refuses it.
    """
    counts = read_counts(source)
    result = fit(
        counts,
        anchor=anchors,
        prior_precision=prior_precision,
        ties=Ties(ties),
        level=level,
    )
    doc = {
        name: {"strength": s.strength, "se": s.se, "interval": list(s.interval)}
        for name, s in result.strengths.items()
    }
    print(json.dumps(doc, indent=2))
    tie = "none (ties=none)" if result.tie is None else f"{result.tie:.6g}"
    print(
        f"assay: tie parameter {tie}; {result.comparisons:g} comparisons; anchor "
        f"{', '.join(result.anchor)}; {result.level:g} intervals",
        file=sys.stderr,
    )
    return 0


def read_counts(source: str) -> list[PairCount]:
    """Pair counts from a CSV file, or stdin for "-".

    Either one comparison per row, `a,b,winner` with winner a, b or draw, or one
    pair per row, `a,b,a_wins,b_wins,draws`; a header row naming those columns
    is optional. Blank lines are skipped.

    Raises:
        AssayError: the file cannot be read, or a row is malformed (naming its line).
    """
    name = "stdin" if source == "-" else source
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise AssayError(f"cannot read {name}: {exc}") from exc
    rows = list(_rows(text.splitlines()))
    if rows and [field.lower() for field in rows[0][1]] in (ROWS_HEADER, COUNTS_HEADER):
        rows = rows[1:]
    if not rows:
        raise AssayError(f"{name}: no comparisons")
    width = len(rows[0][1])
    if width not in (3, 5):
        raise AssayError(
            f"{name}:{rows[0][0]}: expected a,b,winner or a,b,a_wins,b_wins,draws, "
            f"got {width} fields"
        )
    for line, fields in rows:
        if len(fields) != width:
            raise AssayError(f"{name}:{line}: expected {width} fields like the first row")
        if fields[0] == fields[1]:
            raise AssayError(f"{name}:{line}: {fields[0]!r} is compared with itself")
    if width == 3:
        for line, (_, _, winner) in rows:
            if winner not in ("a", "b", "draw"):
                raise AssayError(f"{name}:{line}: winner must be a, b or draw, not {winner!r}")
        return count_rows((a, b, w) for _, (a, b, w) in rows)
    return [_count(name, line, fields) for line, fields in rows]


def _rows(lines: Iterable[str]) -> Iterator[tuple[int, list[str]]]:
    """Non-blank CSV rows with their 1-based line numbers, fields stripped."""
    for number, fields in enumerate(csv.reader(lines), start=1):
        stripped = [field.strip() for field in fields]
        if any(stripped):
            yield number, stripped


def _count(name: str, line: int, fields: list[str]) -> PairCount:
    numbers = []
    for column, field in zip(COUNTS_HEADER[2:], fields[2:], strict=True):
        try:
            value = float(field)
        except ValueError:
            raise AssayError(f"{name}:{line}: {column} is not a number: {field!r}") from None
        if not (math.isfinite(value) and value >= 0):
            raise AssayError(f"{name}:{line}: {column} must be finite and >= 0, not {field}")
        numbers.append(value)
    return PairCount(fields[0], fields[1], *numbers)


def sprt_command(
    *,
    policy_fields: dict[str, float | int | bool],
    win_rate: float,
    reps: int,
    seed: int,
    draw_rate: float,
) -> int:
    """Print the sequential test's cost at `win_rate` beside the fixed-n test's.

    The simulation (with draws at `draw_rate`) gives the mean and quantiles of
    comparisons to a decision and the accept/reject rates; without draws the
    exact values from the lattice walk are printed beside it. `ratio` is the
    simulated mean over `fixed_n`, the size of the exact one-sided binomial test
    with the same alpha and beta (it counts decisive comparisons only).

    Raises:
        AssayError: the policy is inconsistent or a rate or count is out of range.
    """
    try:
        policy = SprtPolicy.model_validate(policy_fields)
    except ValidationError as exc:
        raise AssayError(f"invalid SPRT policy: {one_line(exc)}") from exc
    if not (0 <= win_rate <= 1 and 0 <= draw_rate <= 1):
        raise AssayError("--simulate-p and --p-draw must lie in [0, 1]")
    if reps < 1:
        raise AssayError("--reps must be at least 1")
    simulated = simulate(policy, win_rate, reps, seed, p_draw=draw_rate)
    baseline = fixed_n(policy.p0, policy.p1, policy.alpha, policy.beta)
    doc: dict[str, object] = {
        "policy": policy.model_dump(mode="json"),
        "boundaries": {
            "upper": policy.upper,
            "lower": policy.lower,
            "wald_upper": policy.wald_upper,
            "wald_lower": policy.wald_lower,
        },
        "simulate": {"p": win_rate, "p_draw": draw_rate, "reps": reps, "seed": seed},
        "simulated": asdict(simulated),
        "fixed_n": baseline,
        "ratio": simulated.mean_n / baseline,
    }
    if draw_rate == 0:
        doc["exact"] = asdict(operating_characteristics(policy, win_rate))
    print(json.dumps(doc, indent=2))
    return 0
