"""The §15 signals a stage process exports, derived from what its stages commit.

Most signals are facts a stage already publishes: a run's state transition is a
`RunStatusChanged`, a grade is a `RunGraded`, a result is a `RunResult`. So they
are counted from the messages a unit of work *committed* (`Signals.landed`),
never from a handler's intentions: a handler that is run again after a failed
commit counts nothing twice. Handler latency is observed by the consumer around
each handled message.

One `Signals` serves a process: in embedded mode every stage's runner shares it
(one `/metrics` for the process), distributed each stage process has its own.
Labels stay bounded: tenant, workflow, version, state, reason, stage and message
type; never a run, task or message id.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from prometheus_client import CollectorRegistry, Counter, Histogram

from assay.kernel.schema import Versioned
from assay.kernel.scores import Capped, Ranked, Relative, Ungraded
from assay.messages import RunGraded, RunRef, RunResult, RunStatusChanged, UsageRecorded

HANDLER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
"""Seconds: one message's handling, from a millisecond to a long agent step."""
RESULT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
"""Seconds: a task's submission to its result, through every stage."""


class Signals:
    """The process's counters and histograms, registered in its `registry`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        run = ["tenant", "workflow", "version"]
        self.transitions = Counter(
            "assay_run_transitions",
            "Run state transitions (§5.2), counted by the stage that committed them.",
            ["stage", *run, "state"],
            registry=self.registry,
        )
        self.graded = Counter(
            "assay_runs_graded",
            "Runs grading scored, by score variant (relative, ranked, capped).",
            [*run, "score"],
            registry=self.registry,
        )
        self.ungraded = Counter(
            "assay_runs_ungraded",
            "Runs grading ended without a score, by reason (§11.6); beside assay_runs_graded.",
            [*run, "reason"],
            registry=self.registry,
        )
        self.order_checks = Counter(
            "assay_judge_order_checks",
            "Judge comparisons asked again in the other order, by whether the two answers "
            "agreed; the inconsistent share is the judge's order inconsistency.",
            ["tenant", "workflow", "consistent"],
            registry=self.registry,
        )
        self.spend_usd = Counter(
            "assay_spend_usd",
            "US dollars billed for model calls at the configured prices, by what the call "
            "served (work, shadow, grading, calibration, proposer, replay).",
            ["tenant", "purpose"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "assay_model_tokens",
            "Model tokens billed, by what the call served and kind (prompt, completion).",
            ["tenant", "purpose", "kind"],
            registry=self.registry,
        )
        self.handler_seconds = Histogram(
            "assay_handler_seconds",
            "Time to handle one message completely, its commit included.",
            ["stage", "type"],
            buckets=HANDLER_BUCKETS,
            registry=self.registry,
        )
        self.task_to_result_seconds = Histogram(
            "assay_task_to_result_seconds",
            "From a task's submission to its result on assay.results, end to end.",
            ["tenant", "workflow"],
            buckets=RESULT_BUCKETS,
            registry=self.registry,
        )

    def landed(
        self, stage: str, messages: Iterable[Versioned], occurred_at: datetime, now: datetime
    ) -> None:
        """Count what `stage` just committed to its outbox; `occurred_at` is when the fact
        that caused them happened (a result's task was submitted then)."""
        for msg in messages:
            match msg:
                case RunStatusChanged(run=r, state=state):
                    self.transitions.labels(stage, *_run_labels(r), state.value).inc()
                case RunGraded(run=r, score=score):
                    self._graded(_run_labels(r), score)
                case UsageRecorded():
                    self._billed(msg)
                case RunResult():
                    elapsed = max((now - occurred_at).total_seconds(), 0.0)
                    self.task_to_result_seconds.labels(
                        str(msg.tenant), str(msg.workflow_id)
                    ).observe(elapsed)

    def _graded(self, labels: tuple[str, str, str], score: object) -> None:
        match score:
            case Ungraded(reason=reason):
                self.ungraded.labels(*labels, reason.value).inc()
            case Relative(order_consistent=consistent):
                self.graded.labels(*labels, "relative").inc()
                if consistent is not None:
                    self.order_checked(labels[0], labels[1], consistent=consistent)
            case Ranked():
                self.graded.labels(*labels, "ranked").inc()
            case Capped():
                self.graded.labels(*labels, "capped").inc()

    def _billed(self, usage: UsageRecorded) -> None:
        # not by model: a workflow names its model, so the label would be tenant-supplied
        labels = (str(usage.tenant), usage.purpose.value)
        self.spend_usd.labels(*labels).inc(usage.cost_usd)
        self.tokens.labels(*labels, "prompt").inc(usage.prompt_tokens)
        self.tokens.labels(*labels, "completion").inc(usage.completion_tokens)

    def order_checked(self, tenant: str, workflow: str, *, consistent: bool) -> None:
        """One judge comparison asked again in the other order. A pairwise one is counted
        from its committed `Relative` score; a tournament group's bouts (each judged in
        both orders, scored as one `Ranked` per entrant) are counted by the stage once
        its grading commits (`UnitOfWork.on_landed`)."""
        self.order_checks.labels(tenant, workflow, str(consistent).lower()).inc()

    def handled(self, stage: str, type_: str, seconds: float) -> None:
        """One message of `type_` handled by `stage` in `seconds`."""
        self.handler_seconds.labels(stage, type_).observe(seconds)


def _run_labels(run: RunRef) -> tuple[str, str, str]:
    return str(run.tenant), str(run.workflow_id), str(run.workflow_version)
