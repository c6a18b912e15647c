"""Per workload class: wait distributions, saving, overhead and a gate of its own.

A class is a workflow id and version (`TraceHeader.workload_class`). Each class is
simulated and gated alone, and must hold at least `minimum_traces_per_class` traces;
the whole passes only when at least `minimum_workload_classes` classes do and every
class passes — so a strong class cannot hide a weak one.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from assay.fleet.errors import FleetError
from assay.fleet.metrics import MetricsSummary, observed
from assay.fleet.simulate import Gates, Policy, simulate
from assay.fleet.trace import Trace, WaitKind

PERCENTILES = (50, 95, 99)


@dataclass(frozen=True)
class Minimums:
    """How much evidence a verdict needs."""

    traces_per_class: int = 30
    workload_classes: int = 2

    def __post_init__(self) -> None:
        if self.traces_per_class < 1 or self.workload_classes < 1:
            raise FleetError("the minimum traces per class and classes must be at least 1")


def percentile(sorted_ms: Sequence[int], p: int) -> int:
    """The nearest-rank `p`th percentile of sorted values (an observed value, exact)."""
    return sorted_ms[max(0, math.ceil(p / 100 * len(sorted_ms)) - 1)]


def wait_stats(traces: Sequence[Trace]) -> dict[str, Any]:
    """Per wait kind: how many, their total, and p50/p95/p99, in seconds."""
    by_kind: dict[WaitKind, list[int]] = defaultdict(list)
    for t in traces:
        for w in t.waits():
            by_kind[w.kind].append(w.duration_ms)
    out: dict[str, Any] = {}
    for kind in WaitKind:
        values = sorted(by_kind.get(kind, []))
        stats: dict[str, Any] = {"count": len(values), "total_seconds": sum(values) / 1000}
        for p in PERCENTILES:
            stats[f"p{p}_seconds"] = percentile(values, p) / 1000 if values else None
        out[kind.value] = stats
    return out


def analyze(
    traces: Sequence[Trace],
    policy: Policy,
    gates: Gates,
    minimums: Minimums,
    metrics: Sequence[MetricsSummary | None] = (),
) -> dict[str, Any]:
    """The report: each class's waits, simulation and verdict, and the overall verdict.

    `metrics`, when given, holds each trace's recorder metrics (or None), in the order of
    `traces`; a class with any is reported with what they observed. They never change a
    verdict: they are supporting evidence.
    """
    classes: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(traces):
        classes[t.header.workload_class].append(i)
    report: dict[str, Any] = {}
    failing: list[str] = []
    for name in sorted(classes):
        members = [traces[i] for i in classes[name]]
        recorded = [
            (m, traces[i].duration_ms)
            for i in classes[name]
            if i < len(metrics) and (m := metrics[i]) is not None
        ]
        result = simulate(members, policy)
        reasons = result.verdict(gates)
        if len(members) < minimums.traces_per_class:
            reasons.insert(0, f"{len(members)} traces < {minimums.traces_per_class} per class")
        if reasons:
            failing.append(name)
        report[name] = {
            "traces": len(members),
            "waits": wait_stats(members),
            "result": result.to_json(),
            "gate": {"passed": not reasons, "reasons": reasons},
        }
        if recorded:
            report[name]["observed"] = observed([m for m, _ in recorded], [d for _, d in recorded])
    overall = []
    if len(classes) < minimums.workload_classes:
        overall.append(f"{len(classes)} workload classes < {minimums.workload_classes}")
    overall.extend(f"class {name} fails its gate" for name in failing)
    return {
        "policy": policy.to_json(),
        "gates": gates.to_json(),
        "minimums": {
            "traces_per_class": minimums.traces_per_class,
            "workload_classes": minimums.workload_classes,
        },
        "classes": report,
        "passed": not overall,
        "reasons": overall,
    }
