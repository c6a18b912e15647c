"""A range of `idle_after` values per class: the frontier of saving against overhead.

A point is on the frontier when no other point of its class saves at least as much
CPU and memory with no more overhead, and is better in one of the three. The plot is
plain SVG written here — overhead across, CPU saving up, one line per class, frontier
points filled, the gate's corner drawn — with nothing that varies between runs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from xml.sax.saxutils import escape

from assay.fleet.errors import FleetError
from assay.fleet.simulate import Gates, Policy, SetResult, simulate
from assay.fleet.trace import Trace

MAX_POINTS = 1000


@dataclass(frozen=True)
class Point:
    """One class under one `idle_after`."""

    idle_after_ms: int
    result: SetResult
    passes: bool
    frontier: bool = False

    def to_json(self) -> dict[str, Any]:
        """The point as reported."""
        return {
            "idle_after_s": self.idle_after_ms / 1000,
            "cpu_saving": round(self.result.cpu_saving, 6),
            "memory_saving": round(self.result.memory_saving, 6),
            "overhead": round(self.result.overhead, 6),
            "gate_passed": self.passes,
            "frontier": self.frontier,
        }


def idle_values(start_s: float, stop_s: float, step_s: float) -> list[float]:
    """`start`, `start + step`, ... up to `stop` inclusive.

    Raises:
        FleetError: an empty or unbounded range, or more than 1000 values.
    """
    if not (step_s > 0 and 0 <= start_s <= stop_s):
        raise FleetError("the sweep needs 0 <= --from <= --to and --step > 0")
    n = int((stop_s - start_s) / step_s + 1e-9) + 1
    if n > MAX_POINTS:
        raise FleetError(f"the sweep has {n} values; at most {MAX_POINTS}")
    return [round(start_s + i * step_s, 6) for i in range(n)]


def _dominates(a: SetResult, b: SetResult) -> bool:
    no_worse = (
        a.cpu_saving >= b.cpu_saving
        and a.memory_saving >= b.memory_saving
        and a.overhead <= b.overhead
    )
    better = (
        a.cpu_saving > b.cpu_saving or a.memory_saving > b.memory_saving or a.overhead < b.overhead
    )
    return no_worse and better


def sweep(
    traces: Sequence[Trace], base: Policy, idle_after_s: Sequence[float], gates: Gates
) -> dict[str, list[Point]]:
    """Per workload class, one point per `idle_after` (the rest of `base` kept)."""
    classes: dict[str, list[Trace]] = defaultdict(list)
    for t in traces:
        classes[t.header.workload_class].append(t)
    out: dict[str, list[Point]] = {}
    for name in sorted(classes):
        points = []
        for s in idle_after_s:
            policy = Policy.from_seconds(
                s, base.checkpoint_ms / 1000, base.resume_ms / 1000, base.kinds
            )
            r = simulate(classes[name], policy)
            points.append(Point(policy.idle_after_ms, r, not r.verdict(gates)))
        out[name] = [
            Point(
                p.idle_after_ms,
                p.result,
                p.passes,
                not any(_dominates(q.result, p.result) for q in points),
            )
            for p in points
        ]
    return out


def render_table(points: dict[str, list[Point]]) -> str:
    """A text table per class; `*` marks the frontier."""
    lines = []
    for name, ps in points.items():
        lines.append(f"class {name}")
        lines.append("  idle_after_s  cpu_saving  memory_saving  overhead  gate  frontier")
        for p in ps:
            r = p.result
            lines.append(
                f"  {p.idle_after_ms / 1000:12.3f}  {r.cpu_saving:10.2%}  {r.memory_saving:13.2%}"
                f"  {r.overhead:8.2%}  {'pass' if p.passes else 'fail':4}  "
                f"{'*' if p.frontier else ''}".rstrip()
            )
    return "\n".join(lines) + "\n"


_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf")
_W, _H, _L, _R, _T, _B = 640, 420, 60, 200, 20, 50


def render_svg(points: dict[str, list[Point]], gates: Gates) -> str:
    """The frontier as an SVG document: overhead (x) against CPU saving (y)."""
    every = [p for ps in points.values() for p in ps]
    x_max = max([gates.max_overhead * 2, *(p.result.overhead for p in every)]) or 0.1
    y_lo = min([0.0, *(p.result.cpu_saving for p in every)])
    y_hi = max([gates.min_cpu_saving * 2, *(p.result.cpu_saving for p in every)]) or 1.0
    pw, ph = _W - _L - _R, _H - _T - _B

    def x(v: float) -> float:
        return round(_L + v / x_max * pw, 2)

    def y(v: float) -> float:
        return round(_T + ph - (v - y_lo) / (y_hi - y_lo) * ph, 2)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" '
        f'viewBox="0 0 {_W} {_H}" font-family="sans-serif" font-size="11">',
        f'<rect x="0" y="0" width="{_W}" height="{_H}" fill="white"/>',
        f'<rect x="{_L}" y="{_T}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>',
        # the gate's corner: enough saving, little enough overhead
        f'<rect x="{_L}" y="{_T}" width="{x(gates.max_overhead) - _L}" '
        f'height="{y(gates.min_cpu_saving) - _T}" fill="#2ca02c" fill-opacity="0.08" '
        'stroke="#2ca02c" stroke-dasharray="4 3"/>',
        f'<text x="{_L + pw / 2}" y="{_H - 12}" text-anchor="middle">'
        "completion-time overhead</text>",
        f'<text x="14" y="{_T + ph / 2}" text-anchor="middle" '
        f'transform="rotate(-90 14 {_T + ph / 2})">CPU resource-time saved</text>',
    ]
    for i in range(5):
        xv, yv = x_max * i / 4, y_lo + (y_hi - y_lo) * i / 4
        out.append(f'<text x="{x(xv)}" y="{_T + ph + 14}" text-anchor="middle">{xv:.1%}</text>')
        out.append(f'<text x="{_L - 4}" y="{y(yv) + 4}" text-anchor="end">{yv:.0%}</text>')
    for n, (name, ps) in enumerate(points.items()):
        colour = _COLOURS[n % len(_COLOURS)]
        coords = " ".join(f"{x(p.result.overhead)},{y(p.result.cpu_saving)}" for p in ps)
        out.append(f'<polyline points="{coords}" fill="none" stroke="{colour}"/>')
        for p in ps:
            fill = colour if p.frontier else "white"
            out.append(
                f'<circle cx="{x(p.result.overhead)}" cy="{y(p.result.cpu_saving)}" r="3.5" '
                f'fill="{fill}" stroke="{colour}"><title>idle_after {p.idle_after_ms / 1000:g} s'
                "</title></circle>"
            )
        ly = _T + 14 + 16 * n
        out.append(
            f'<rect x="{_W - _R + 12}" y="{ly - 9}" width="10" height="10" fill="{colour}"/>'
        )
        out.append(f'<text x="{_W - _R + 28}" y="{ly}">{escape(name[:28])}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
