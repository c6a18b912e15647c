"""The ladder's thresholds on `/metrics`, so an alert compares a signal against the
setting decide acts on instead of repeating its value (§15).

The judge's order inconsistency is counted where grading commits it
(`assay_judge_order_checks_total`); the ladder's drift check refuses to promote a
challenger whose judge contradicted itself more often than
`ASSAY_LADDER_MAX_ORDER_INCONSISTENCY`. Exporting that setting lets the alert on the
first read against the second, whatever an operator set it to.
"""

from __future__ import annotations

from assay.grading.ladder import LadderPolicy
from assay.runtime.stage import Gauge
from assay.store import EventLog

__all__ = ["threshold_gauges"]


async def threshold_gauges(log: EventLog, ladder: LadderPolicy) -> list[Gauge]:
    """The ladder settings an alert compares against (unlabelled: one value per process;
    `log` is not read, the value is configuration)."""
    del log
    return [
        Gauge(
            "assay_ladder_max_order_inconsistency",
            "The largest share of order checks the judge may contradict itself on for a "
            "challenger to be promoted (ASSAY_LADDER_MAX_ORDER_INCONSISTENCY).",
            (),
            (((), ladder.max_order_inconsistency),),
        )
    ]
