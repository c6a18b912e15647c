"""Prometheus metrics of one process, read from its stage runners at scrape time.

Nothing is added to the commit path: a collector reads the counters the runners
and relays already keep, the gauges each stage derives from committed state
(`StageSpec.gauges`) and each stage's lag, which `refresh` reads just before a
scrape; beside them, the §15 signals the runners count as they commit
(`assay.runtime.signals`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Metric
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from assay.runtime.consumer import StageRunner
from assay.runtime.stage import Gauge

log = logging.getLogger(__name__)


class StagesCollector(Collector):
    """Counters and gauges of the `StageRunner`s of one process (one, distributed; every
    stage, embedded), each sample labelled with its stage."""

    def __init__(self, runners: Sequence[StageRunner]) -> None:
        self.runners = tuple(runners)
        self.derived: dict[str, tuple[Gauge, ...]] = {}
        """Each stage's gauges as `refresh` last read them."""
        self.lag: dict[str, dict[tuple[str, int], int]] = {}
        """Each stage's records not yet handled, per partition it holds, as last read."""

    async def refresh(self) -> None:
        """Read the stages' derived gauges from their committed state, and their lag."""
        for runner in self.runners:
            name = runner.spec.name
            try:
                self.lag[name] = await runner.lag()
                if runner.spec.gauges is not None:
                    self.derived[name] = tuple(await runner.spec.gauges(runner.log))
            except Exception:  # a scrape still answers with the counters and the last reading
                log.warning("stage %s: reading its gauges failed", name, exc_info=True)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        families: dict[str, GaugeMetricFamily] = {}
        for gauges in self.derived.values():
            for gauge in gauges:
                family = families.setdefault(
                    gauge.name, GaugeMetricFamily(gauge.name, gauge.help, labels=list(gauge.labels))
                )
                for labels, value in gauge.samples:
                    family.add_metric(list(labels), value)
        yield from families.values()
        for name, help_, read in _COUNTERS:
            counter = CounterMetricFamily(name, help_, labels=["stage"])
            for runner in self.runners:
                counter.add_metric([runner.spec.name], read(runner))
            yield counter
        emitted = CounterMetricFamily(
            "assay_messages_emitted",
            "Messages a stage committed to its outbox, by type.",
            labels=["stage", "type"],
        )
        for runner in self.runners:
            for kind, count in sorted(runner.emitted.items()):
                emitted.add_metric([runner.spec.name, kind], count)
        yield emitted
        lag = GaugeMetricFamily(
            "assay_stage_lag",
            "Records not yet handled, per partition the stage holds: the broker's end offset "
            "minus the position the stage stored in its own commit.",
            labels=["stage", "topic", "partition"],
        )
        for stage, behind in sorted(self.lag.items()):
            for (topic, partition), count in sorted(behind.items()):
                lag.add_metric([stage, topic, str(partition)], count)
        yield lag


_COUNTERS: tuple[tuple[str, str, Callable[[StageRunner], float]], ...] = (
    ("assay_messages_handled", "Messages a stage handled and committed.", lambda r: r.handled),
    (
        "assay_duplicates_skipped",
        "Messages the inbox had already seen (redeliveries, re-publishes); not handled again.",
        lambda r: r.duplicates,
    ),
    (
        "assay_dead_letters",
        "Messages refused to the stage's dead-letter topic.",
        lambda r: r.dead_lettered,
    ),
    (
        "assay_messages_abandoned",
        "Messages given up because another worker took their run over (stale fence, lost "
        "lease); that worker owns their outcome.",
        lambda r: r.abandoned,
    ),
    (
        "assay_indeterminate_attempts",
        "Operator alert: attempts whose dispatched Unsafe call has an unknown outcome.",
        lambda r: r.emitted["AttemptIndeterminate"],
    ),
    ("assay_outbox_shipped", "Outbox rows the relay published.", lambda r: r.relay.shipped),
)


class StageCollector(StagesCollector):
    """The collector of one stage's runner (a stage process)."""

    def __init__(self, runner: StageRunner) -> None:
        super().__init__([runner])


class _Signals(Collector):
    """Forwards a `Signals` registry, so each registry built here holds it once."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        yield from self.registry.collect()


def process_registry(collector: StagesCollector) -> CollectorRegistry:
    """A registry exposing a process's runners (their counters, gauges and lag) and the
    §15 signals they share."""
    registry = CollectorRegistry()
    registry.register(collector)
    for signals in {id(r.signals): r.signals for r in collector.runners}.values():
        registry.register(_Signals(signals.registry))
    for runner in collector.runners:
        for own in runner.spec.metrics:
            registry.register(_Signals(own))
    return registry


def stage_registry(
    runner: StageRunner, collector: StageCollector | None = None
) -> CollectorRegistry:
    """A registry exposing one runner's metrics (through `collector`, if given: the one
    whose `refresh` the status server calls before a scrape)."""
    return process_registry(collector or StageCollector(runner))
