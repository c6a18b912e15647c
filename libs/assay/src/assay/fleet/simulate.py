"""Always-on sandboxes against idle suspension, on traces (DESIGN §16). Pure and exact.

The model, per wait of `w` ms on a run whose sandbox declares `c` cores and `g` GiB:

- always-on holds the sandbox from `run_started` to `run_finished` (`D` ms);
- with suspension, a wait longer than `idle_after` (strictly) is suspended: the
  controller starts a checkpoint once the sandbox has been idle `idle_after`, holds the
  sandbox while the checkpoint takes `checkpoint`, then releases it until the wait ends;
  the run then waits for the resume (`resume`), holding the sandbox again. A wait that
  ends while the checkpoint is still being taken waits for it to finish, then resumes.

  released = max(0, w - idle_after - checkpoint)
  added    = resume + max(0, idle_after + checkpoint - w)   (latency on the critical path)

  The suspended run lasts `D + Σ added` and holds the sandbox `D + Σ added - Σ released`.

Resource-time is `c × held` core-seconds and `g × held` GiB-seconds; a set's saving is
`1 - suspended / always-on` summed over its traces, and its completion-time overhead
`Σ added / Σ D`. All arithmetic is on integer milliseconds; only the ratios are floats.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from assay.fleet.errors import FleetError
from assay.fleet.trace import Trace, Wait, WaitKind

ALL_KINDS = frozenset(WaitKind)


@dataclass(frozen=True)
class Policy:
    """Idle suspension: after `idle_after_ms` idle in a wait of one of `kinds`."""

    idle_after_ms: int
    checkpoint_ms: int = 0
    resume_ms: int = 0
    kinds: frozenset[WaitKind] = ALL_KINDS

    def __post_init__(self) -> None:
        for name in ("idle_after_ms", "checkpoint_ms", "resume_ms"):
            if getattr(self, name) < 0:
                raise FleetError(f"{name.removesuffix('_ms')} must not be negative")
        if not self.kinds:
            raise FleetError("the policy suspends no kind of wait")

    @classmethod
    def from_seconds(
        cls,
        idle_after_s: float,
        checkpoint_s: float = 0.0,
        resume_s: float = 0.0,
        kinds: Iterable[WaitKind] = ALL_KINDS,
    ) -> Policy:
        """A policy given in seconds, rounded to milliseconds.

        Raises:
            FleetError: a negative or non-finite time, or no kinds.
        """
        return cls(_ms(idle_after_s), _ms(checkpoint_s), _ms(resume_s), frozenset(kinds))

    def to_json(self) -> dict[str, Any]:
        """The policy as it is reported."""
        return {
            "idle_after_s": self.idle_after_ms / 1000,
            "checkpoint_s": self.checkpoint_ms / 1000,
            "resume_s": self.resume_ms / 1000,
            "kinds": sorted(k.value for k in self.kinds),
        }


def _ms(seconds: float) -> int:
    if not seconds >= 0 or seconds == float("inf"):
        raise FleetError(f"times must be finite seconds >= 0, not {seconds}")
    return round(seconds * 1000)


@dataclass(frozen=True)
class Gates:
    """The acceptance gate; the defaults are the seed's hypothesis gate."""

    min_cpu_saving: float = 0.20
    min_memory_saving: float = 0.20
    max_overhead: float = 0.05

    def to_json(self) -> dict[str, float]:
        """The gate as it is reported."""
        return {
            "min_cpu_saving": self.min_cpu_saving,
            "min_memory_saving": self.min_memory_saving,
            "max_overhead": self.max_overhead,
        }


@dataclass(frozen=True)
class Suspension:
    """One suspended wait: what it released and what it added to the run."""

    wait: Wait
    released_ms: int
    added_ms: int


def suspension(wait: Wait, policy: Policy) -> Suspension | None:
    """How `policy` treats `wait`: None when it is not suspended."""
    if wait.kind not in policy.kinds or wait.duration_ms <= policy.idle_after_ms:
        return None
    held = policy.idle_after_ms + policy.checkpoint_ms
    return Suspension(
        wait,
        released_ms=max(0, wait.duration_ms - held),
        added_ms=policy.resume_ms + max(0, held - wait.duration_ms),
    )


@dataclass(frozen=True)
class TraceOutcome:
    """One trace under a policy, in milliseconds."""

    duration_ms: int
    released_ms: int
    added_ms: int
    suspensions: int
    cpu_cores: float
    memory_gib: float

    @property
    def held_ms(self) -> int:
        """How long the suspended run holds its sandbox."""
        return self.duration_ms + self.added_ms - self.released_ms


def simulate_trace(trace: Trace, policy: Policy) -> TraceOutcome:
    """`trace` under `policy`."""
    done = [s for w in trace.waits() if (s := suspension(w, policy)) is not None]
    return TraceOutcome(
        duration_ms=trace.duration_ms,
        released_ms=sum(s.released_ms for s in done),
        added_ms=sum(s.added_ms for s in done),
        suspensions=len(done),
        cpu_cores=trace.header.cpu_cores,
        memory_gib=trace.header.memory_gib,
    )


@dataclass(frozen=True)
class SetResult:
    """A set of traces under a policy: resource-time both ways, saving and overhead."""

    traces: int
    suspensions: int
    always_on_cpu_core_s: float
    suspended_cpu_core_s: float
    always_on_memory_gib_s: float
    suspended_memory_gib_s: float
    baseline_ms: int
    added_ms: int
    outcomes: tuple[TraceOutcome, ...] = field(repr=False)

    @property
    def cpu_saving(self) -> float:
        """Fraction of CPU resource-time saved (negative: suspension costs more)."""
        return _saving(self.always_on_cpu_core_s, self.suspended_cpu_core_s)

    @property
    def memory_saving(self) -> float:
        """Fraction of memory resource-time saved."""
        return _saving(self.always_on_memory_gib_s, self.suspended_memory_gib_s)

    @property
    def overhead(self) -> float:
        """Aggregate completion-time overhead: added time over always-on time."""
        return self.added_ms / self.baseline_ms if self.baseline_ms else 0.0

    def verdict(self, gates: Gates) -> list[str]:
        """Why the set fails `gates`; empty when it passes."""
        why = []
        if self.cpu_saving < gates.min_cpu_saving:
            why.append(f"CPU saving {self.cpu_saving:.2%} < {gates.min_cpu_saving:.2%}")
        if self.memory_saving < gates.min_memory_saving:
            why.append(f"memory saving {self.memory_saving:.2%} < {gates.min_memory_saving:.2%}")
        if self.overhead > gates.max_overhead:
            why.append(f"overhead {self.overhead:.2%} > {gates.max_overhead:.2%}")
        return why

    def to_json(self) -> dict[str, Any]:
        """The figures as reported (ratios to six places, resource-time to three)."""
        return {
            "traces": self.traces,
            "suspensions": self.suspensions,
            "always_on": {
                "cpu_core_seconds": round(self.always_on_cpu_core_s, 3),
                "memory_gib_seconds": round(self.always_on_memory_gib_s, 3),
                "completion_seconds": self.baseline_ms / 1000,
            },
            "suspended": {
                "cpu_core_seconds": round(self.suspended_cpu_core_s, 3),
                "memory_gib_seconds": round(self.suspended_memory_gib_s, 3),
                "completion_seconds": (self.baseline_ms + self.added_ms) / 1000,
            },
            "cpu_saving": round(self.cpu_saving, 6),
            "memory_saving": round(self.memory_saving, 6),
            "overhead": round(self.overhead, 6),
        }


def _saving(before: float, after: float) -> float:
    return 1.0 - after / before if before else 0.0


def simulate(traces: Sequence[Trace], policy: Policy) -> SetResult:
    """Every trace of `traces` under `policy`, summed."""
    outs = tuple(simulate_trace(t, policy) for t in traces)
    return SetResult(
        traces=len(outs),
        suspensions=sum(o.suspensions for o in outs),
        always_on_cpu_core_s=sum(o.cpu_cores * o.duration_ms for o in outs) / 1000,
        suspended_cpu_core_s=sum(o.cpu_cores * o.held_ms for o in outs) / 1000,
        always_on_memory_gib_s=sum(o.memory_gib * o.duration_ms for o in outs) / 1000,
        suspended_memory_gib_s=sum(o.memory_gib * o.held_ms for o in outs) / 1000,
        baseline_ms=sum(o.duration_ms for o in outs),
        added_ms=sum(o.added_ms for o in outs),
        outcomes=outs,
    )
