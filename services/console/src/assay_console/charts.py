"""Geometry of the console's charts, computed on the server and drawn as inline SVG by
the templates: the sequential test's path between its boundaries, a forest plot of
strengths against control, and a workflow's version DAG. Pure functions, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from assay.engine.episode_view import RunView
from assay_console.workflow_views import SprtPath, SprtPoint, Strength, VersionNode

WIDTH, HEIGHT = 640, 260
LEFT, RIGHT, TOP, BOTTOM = 56, 20, 16, 36


@dataclass(frozen=True)
class Tick:
    """An axis tick: where, and its label."""

    at: float
    label: str


@dataclass(frozen=True)
class Marker:
    """A drawn point and what it shows."""

    x: float
    y: float
    point: SprtPoint


@dataclass(frozen=True)
class SprtChart:
    """The log-likelihood ratio against comparisons, with both boundaries."""

    width: int
    height: int
    left: int
    right: int
    top: int
    bottom: int
    upper_y: float
    lower_y: float
    zero_y: float
    earlier: str
    """Polyline of the points under an earlier policy (drawn dashed); may be empty."""
    path: str
    """Polyline of the points under the latest policy."""
    markers: list[Marker]
    crossing: Marker | None
    x_ticks: list[Tick]
    y_ticks: list[Tick]


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    span = hi - lo or 1.0
    raw = span / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    return f"{v:g}" if abs(v) >= 1e-9 else "0"


def sprt_chart(path: SprtPath) -> SprtChart:
    """The chart of a test's path: x is comparisons, y the ratio, both boundaries drawn."""
    xs = [p.comparisons for p in path.points]
    ys = [p.llr for p in path.points]
    x_max = max(max(xs), 10)
    span = path.upper - path.lower
    y_lo = min(min(ys), path.lower) - 0.1 * span
    y_hi = max(max(ys), path.upper) + 0.1 * span
    inner_w, inner_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def sx(x: float) -> float:
        return round(LEFT + inner_w * x / x_max, 2)

    def sy(y: float) -> float:
        return round(TOP + inner_h * (y_hi - y) / (y_hi - y_lo), 2)

    markers = [Marker(sx(p.comparisons), sy(p.llr), p) for p in path.points]
    split = next((i for i, p in enumerate(path.points) if not p.policy_changed), len(markers))
    earlier = " ".join(f"{m.x},{m.y}" for m in markers[: split + 1]) if split else ""
    latest = " ".join(f"{m.x},{m.y}" for m in markers[split:])
    crossing = next(
        (m for m in markers if m.point.llr >= path.upper or m.point.llr <= path.lower), None
    )
    return SprtChart(
        width=WIDTH,
        height=HEIGHT,
        left=LEFT,
        right=RIGHT,
        top=TOP,
        bottom=BOTTOM,
        upper_y=sy(path.upper),
        lower_y=sy(path.lower),
        zero_y=sy(0.0),
        earlier=earlier,
        path=latest,
        markers=markers,
        crossing=crossing,
        x_ticks=[Tick(sx(t), _fmt(t)) for t in _ticks(0, x_max) if t <= x_max],
        y_ticks=[Tick(sy(t), _fmt(t)) for t in _ticks(y_lo, y_hi) if y_lo <= t <= y_hi],
    )


@dataclass(frozen=True)
class ForestRow:
    """One strength: its interval as a line, its mean as a point."""

    y: float
    low_x: float
    mean_x: float
    high_x: float
    strength: Strength


@dataclass(frozen=True)
class ForestChart:
    """Strengths from control with their intervals; control is the line at zero."""

    width: int
    height: int
    left: int
    right: int
    top: int
    bottom: int
    zero_x: float
    rows: list[ForestRow]
    x_ticks: list[Tick]


FOREST_ROW = 28
FOREST_LEFT = 230


def forest_chart(strengths: list[Strength]) -> ForestChart:
    """The forest plot of `strengths` (at least one), control (zero) always in view."""
    lo = min(0.0, *(s.low for s in strengths))
    hi = max(0.0, *(s.high for s in strengths))
    pad = 0.1 * (hi - lo or 1.0)
    lo, hi = lo - pad, hi + pad
    height = TOP + BOTTOM + FOREST_ROW * len(strengths)
    inner_w = WIDTH - FOREST_LEFT - RIGHT

    def sx(x: float) -> float:
        return round(FOREST_LEFT + inner_w * (x - lo) / (hi - lo), 2)

    rows = [
        ForestRow(TOP + FOREST_ROW * (i + 0.5), sx(s.low), sx(s.mean), sx(s.high), s)
        for i, s in enumerate(strengths)
    ]
    return ForestChart(
        width=WIDTH,
        height=height,
        left=FOREST_LEFT,
        right=RIGHT,
        top=TOP,
        bottom=BOTTOM,
        zero_x=sx(0.0),
        rows=rows,
        x_ticks=[Tick(sx(t), _fmt(round(t, 6))) for t in _ticks(lo, hi) if lo <= t <= hi],
    )


@dataclass(frozen=True)
class DagNode:
    """A version in the drawn DAG."""

    x: float
    y: float
    node: VersionNode


@dataclass(frozen=True)
class DagChart:
    """Versions top to bottom in registration order; each edge a curve from a parent."""

    width: int
    height: int
    nodes: list[DagNode]
    edges: list[str]
    """SVG path data, one per parent -> child edge."""


DAG_ROW = 30
DAG_X = 40


def dag_chart(versions: list[VersionNode]) -> DagChart:
    """The DAG of `versions`: a git-log-like column, edges bulging left by their length."""
    place = {v.version: i for i, v in enumerate(versions)}
    nodes = [DagNode(DAG_X, 16 + DAG_ROW * i, v) for i, v in enumerate(versions)]
    edges = []
    for child, v in enumerate(versions):
        for parent in v.parents:
            if parent not in place:
                continue
            y0, y1 = 16 + DAG_ROW * place[parent], 16 + DAG_ROW * child
            bulge = DAG_X - 10 - 6 * min(abs(child - place[parent]), 4)
            if abs(child - place[parent]) == 1:
                edges.append(f"M{DAG_X},{y0} L{DAG_X},{y1}")
            else:
                edges.append(f"M{DAG_X},{y0} C{bulge},{y0} {bulge},{y1} {DAG_X},{y1}")
    return DagChart(
        width=WIDTH, height=DAG_ROW * max(len(versions), 1) + 4, nodes=nodes, edges=edges
    )


@dataclass(frozen=True)
class Line:
    """One series of a time chart, as a polyline, with its points."""

    name: str
    points: str
    dots: list[tuple[float, float, str]]
    """x, y and the value's label, for each point."""


@dataclass(frozen=True)
class Limit:
    """A horizontal line: a ceiling or a threshold."""

    name: str
    y: float
    label: str


@dataclass(frozen=True)
class TimeChart:
    """Series over time (x: UTC buckets), with horizontal limits."""

    width: int
    height: int
    left: int
    right: int
    top: int
    bottom: int
    lines: list[Line]
    limits: list[Limit]
    x_ticks: list[Tick]
    y_ticks: list[Tick]


def time_chart(
    xs: list[str],
    series: Mapping[str, Sequence[float | None]],
    limits: dict[str, float],
    y_max: float = 0.0,
) -> TimeChart:
    """Each series against the bucket labels `xs` (one value per bucket; None: no value
    there, no point, the line joins its neighbours), and each limit as a line; the y
    axis starts at zero and reaches the largest value, limit or `y_max`."""
    values_ = [v for vs in series.values() for v in vs if v is not None]
    top_value = max([y_max, *limits.values(), *values_])
    y_hi = top_value * 1.1 or 1.0
    inner_w, inner_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    step = inner_w / max(len(xs) - 1, 1)

    def sx(i: int) -> float:
        return round(LEFT + step * i, 2)

    def sy(y: float) -> float:
        return round(TOP + inner_h * (y_hi - y) / y_hi, 2)

    lines = [
        Line(
            name,
            " ".join(f"{sx(i)},{sy(v)}" for i, v in enumerate(values) if v is not None),
            [(sx(i), sy(v), _fmt(round(v, 6))) for i, v in enumerate(values) if v is not None],
        )
        for name, values in series.items()
    ]
    every = max(1, len(xs) // 6)
    return TimeChart(
        width=WIDTH,
        height=HEIGHT,
        left=LEFT,
        right=RIGHT,
        top=TOP,
        bottom=BOTTOM,
        lines=lines,
        limits=[Limit(name, sy(v), _fmt(v)) for name, v in limits.items()],
        x_ticks=[Tick(sx(i), x) for i, x in enumerate(xs) if i % every == 0],
        y_ticks=[Tick(sy(t), _fmt(t)) for t in _ticks(0.0, y_hi) if 0 <= t <= y_hi],
    )


@dataclass(frozen=True)
class AttemptBar:
    """One attempt on the run's timeline: its row and its bar."""

    branch: int
    step: str
    attempt: int
    state: str
    started_ms: int
    duration_ms: int | None
    error: str | None
    x: float
    width: float
    y: float


@dataclass(frozen=True)
class AttemptTimeline:
    """Every attempt of the shown branches against wall-clock time from the first start."""

    width: int
    height: int
    left: int
    span_ms: int
    bars: list[AttemptBar]


ATTEMPT_ROW = 22
ATTEMPT_LEFT = 200


def attempt_timeline(view: RunView) -> AttemptTimeline:
    """Bars for each attempt of each branch of `view`, in order of start; an unfinished
    attempt runs to the latest time the view knows."""
    attempts = [(b.branch, s.step, a) for b in view.branches for s in b.steps for a in s.attempts]
    if not attempts:
        return AttemptTimeline(WIDTH, TOP + BOTTOM, ATTEMPT_LEFT, 0, [])
    start = min(a.started_at_ms for _, _, a in attempts)
    end = max(a.started_at_ms + (a.duration_ms or 0) for _, _, a in attempts)
    span = max(end - start, 1)
    inner = WIDTH - ATTEMPT_LEFT - RIGHT
    bars = []
    for row, (branch, step, a) in enumerate(sorted(attempts, key=lambda t: t[2].started_at_ms)):
        ran = a.duration_ms if a.duration_ms is not None else end - a.started_at_ms
        bars.append(
            AttemptBar(
                branch=branch,
                step=step,
                attempt=a.attempt,
                state=a.state.value,
                started_ms=a.started_at_ms - start,
                duration_ms=a.duration_ms,
                error=a.error,
                x=round(ATTEMPT_LEFT + inner * (a.started_at_ms - start) / span, 2),
                width=max(round(inner * ran / span, 2), 2.0),
                y=TOP + row * ATTEMPT_ROW,
            )
        )
    return AttemptTimeline(WIDTH, TOP + len(bars) * ATTEMPT_ROW + BOTTOM, ATTEMPT_LEFT, span, bars)
