"""Prometheus metrics of one stage process, read from the runner at scrape time.

Nothing is added to the commit path: a collector reads the counters the runner
and relay already keep, and the gauges its stage derives from committed state
(`StageSpec.gauges`), which `refresh` reads just before a scrape.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from assay.runtime.consumer import StageRunner
from assay.runtime.stage import Gauge

log = logging.getLogger(__name__)


class StageCollector(Collector):
    """Counters and gauges of one `StageRunner`."""

    def __init__(self, runner: StageRunner) -> None:
        self.runner = runner
        self.derived: tuple[Gauge, ...] = ()
        """The stage's gauges as `refresh` last read them."""

    async def refresh(self) -> None:
        """Read the stage's derived gauges from its committed state (none if it has none)."""
        read = self.runner.spec.gauges
        if read is None:
            return
        try:
            self.derived = tuple(await read(self.runner.log))
        except Exception:  # a scrape still answers with the counters and the last reading
            log.warning("stage %s: reading its gauges failed", self.runner.spec.name, exc_info=True)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stage = self.runner.spec.name
        for gauge in self.derived:
            family = GaugeMetricFamily(gauge.name, gauge.help, labels=list(gauge.labels))
            for labels, value in gauge.samples:
                family.add_metric(list(labels), value)
            yield family
        handled = CounterMetricFamily(
            "assay_messages_handled", "Messages a stage handled and committed.", labels=["stage"]
        )
        handled.add_metric([stage], self.runner.handled)
        yield handled
        duplicates = CounterMetricFamily(
            "assay_duplicates_skipped",
            "Messages the inbox had already seen (redeliveries, re-publishes); not handled again.",
            labels=["stage"],
        )
        duplicates.add_metric([stage], self.runner.duplicates)
        yield duplicates
        dead = CounterMetricFamily(
            "assay_dead_letters",
            "Messages refused to the stage's dead-letter topic.",
            labels=["stage"],
        )
        dead.add_metric([stage], self.runner.dead_lettered)
        yield dead
        abandoned = CounterMetricFamily(
            "assay_messages_abandoned",
            "Messages given up because another worker took their run over (stale fence, lost "
            "lease); that worker owns their outcome.",
            labels=["stage"],
        )
        abandoned.add_metric([stage], self.runner.abandoned)
        yield abandoned
        emitted = CounterMetricFamily(
            "assay_messages_emitted",
            "Messages a stage committed to its outbox, by type.",
            labels=["stage", "type"],
        )
        for kind, count in sorted(self.runner.emitted.items()):
            emitted.add_metric([stage, kind], count)
        yield emitted
        indeterminate = CounterMetricFamily(
            "assay_indeterminate_attempts",
            "Operator alert: attempts whose dispatched Unsafe call has an unknown outcome.",
            labels=["stage"],
        )
        indeterminate.add_metric([stage], self.runner.emitted["AttemptIndeterminate"])
        yield indeterminate
        shipped = CounterMetricFamily(
            "assay_outbox_shipped", "Outbox rows the relay published.", labels=["stage"]
        )
        shipped.add_metric([stage], self.runner.relay.shipped)
        yield shipped
        lag_of = getattr(self.runner.source, "lag", None)
        if callable(lag_of):
            lag = GaugeMetricFamily(
                "assay_stage_lag",
                "Records not yet handled, per assigned partition.",
                labels=["stage", "topic", "partition"],
            )
            for (topic, partition), behind in sorted(lag_of().items()):
                lag.add_metric([stage, topic, str(partition)], behind)
            yield lag


def stage_registry(
    runner: StageRunner, collector: StageCollector | None = None
) -> CollectorRegistry:
    """A registry exposing one runner's metrics (through `collector`, if given: the one
    whose `refresh` the status server calls before a scrape)."""
    registry = CollectorRegistry()
    registry.register(collector or StageCollector(runner))
    return registry
