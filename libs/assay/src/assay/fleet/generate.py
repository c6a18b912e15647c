"""Seeded synthetic traces: the same seed gives the same bytes.

Useful for testing the model and choosing thresholds — never as evidence of a saving.
Each built-in workload class draws a number of steps; each step is active time
followed by a model wait, a tool wait, a human wait or busy time, with exponential
durations around the class's means. Only `random.Random.random()` is used (its
sequence for an integer seed is stable across Python versions), turned into
exponential draws here, so the bytes do not depend on a library's sampler.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from assay.fleet.errors import FleetError
from assay.fleet.trace import (
    TRACE_FORMAT,
    TRACE_VERSION,
    BusyFinishedEvent,
    BusyStartedEvent,
    RunFinishedEvent,
    RunStartedEvent,
    Trace,
    TraceEvent,
    TraceHeader,
    WaitFinishedEvent,
    WaitKind,
    WaitStartedEvent,
)


@dataclass(frozen=True)
class Profile:
    """A synthetic workload class: sandbox size, step count and mean durations (ms)."""

    name: str
    cpu_cores: float
    memory_gib: float
    steps: tuple[int, int]
    weights: tuple[tuple[str, float, int], ...]
    """(what, probability, mean ms): what is `model`, `tool`, `human` or `busy`."""
    active_ms: int


PROFILES = {
    p.name: p
    for p in (
        Profile(
            "coding-agent",
            cpu_cores=2,
            memory_gib=4,
            steps=(8, 30),
            weights=(("model", 0.5, 12_000), ("tool", 0.15, 3_000), ("busy", 0.35, 6_000)),
            active_ms=400,
        ),
        Profile(
            "review-agent",
            cpu_cores=1,
            memory_gib=2,
            steps=(3, 8),
            weights=(
                ("model", 0.55, 8_000),
                ("tool", 0.2, 1_500),
                ("human", 0.1, 600_000),
                ("busy", 0.15, 2_000),
            ),
            active_ms=300,
        ),
    )
}
"""The built-in synthetic workload classes."""


def _exp(rng: random.Random, mean_ms: int) -> int:
    return max(1, round(-mean_ms * math.log(1.0 - rng.random())))


def _one(profile: Profile, rng: random.Random, index: int) -> Trace:
    t = 0
    events: list[TraceEvent] = [RunStartedEvent(type="run_started", t_ms=0)]
    lo, hi = profile.steps
    for _ in range(lo + int(rng.random() * (hi - lo + 1))):
        t += _exp(rng, profile.active_ms)
        u, what, mean = rng.random(), profile.weights[-1][0], profile.weights[-1][2]
        for name, p, m in profile.weights:
            if u < p:
                what, mean = name, m
                break
            u -= p
        end = t + _exp(rng, mean)
        if what == "busy":
            events.append(BusyStartedEvent(type="busy_started", t_ms=t))
            events.append(BusyFinishedEvent(type="busy_finished", t_ms=end))
        else:
            kind = WaitKind(what)
            events.append(WaitStartedEvent(type="wait_started", t_ms=t, kind=kind))
            events.append(WaitFinishedEvent(type="wait_finished", t_ms=end, kind=kind))
        t = end
    t += _exp(rng, profile.active_ms)
    events.append(RunFinishedEvent(type="run_finished", t_ms=t, outcome="succeeded"))
    header = TraceHeader(
        type="header",
        format=TRACE_FORMAT,
        version=TRACE_VERSION,
        workflow_id=profile.name,
        workflow_version="synthetic",
        run=f"{profile.name}-{index:04d}",
        cpu_cores=profile.cpu_cores,
        memory_gib=profile.memory_gib,
        source="generate",
    )
    return Trace(header, tuple(events))


def generate(seed: int, traces_per_class: int, classes: list[str] | None = None) -> list[Trace]:
    """`traces_per_class` traces of each named class (default: every built-in one).

    Raises:
        FleetError: an unknown class, or fewer than one trace per class.
    """
    if traces_per_class < 1:
        raise FleetError("--traces-per-class must be at least 1")
    names = sorted(classes or PROFILES)
    unknown = [n for n in names if n not in PROFILES]
    if unknown:
        raise FleetError(f"unknown class {unknown[0]!r} (known: {', '.join(sorted(PROFILES))})")
    rng = random.Random(seed)
    return [_one(PROFILES[n], rng, i) for n in names for i in range(traces_per_class)]
