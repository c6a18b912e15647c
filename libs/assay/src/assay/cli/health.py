"""`assay grade health`: each tenant's grading meter, from the tournament stage's state.

Per tenant: judge calls today against the tenant's ceiling and by purpose
(compare, order check, screen, tournament, attempts), the judge's health — the
order-inconsistency rate on sampled order checks and both-order tournament
pairs, judge failures and the last one — and how grading ended, by score kind
and `Ungraded` by reason (§11.6: a tenant whose loop never engages must see a
stated reason, not a silence). Where the state is: with `ASSAY_DATABASE_URL`
set, the `tournament` schema in Postgres; otherwise the data directory's
`tournament.sqlite`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from assay.cli.logs import stage_state
from assay.kernel.ids import TenantId
from assay.runtime.settings import GradingSettings
from assay.store.ports import EventLog

PG_SCHEMA = "tournament"


def report(tenant: TenantId, meter: dict[str, Any], ceiling: int) -> dict[str, Any]:
    """One tenant's health, with the rates computed."""
    checked = int(meter.get("order_checked", 0))
    inconsistent = int(meter.get("order_inconsistent", 0))
    return {
        "tenant": str(tenant),
        "day": meter.get("day"),
        "judge_calls_today": int(meter.get("calls_today", 0)),
        "judge_calls_ceiling": ceiling,
        "budget_exhausted": int(meter.get("calls_today", 0)) >= ceiling,
        "judge_calls_total": int(meter.get("calls_total", 0)),
        "judge_calls_by_purpose": dict(sorted(meter.get("by_purpose", {}).items())),
        "order_checked": checked,
        "order_inconsistent": inconsistent,
        "order_inconsistency_rate": inconsistent / checked if checked else None,
        "judge_failures": int(meter.get("judge_failures", 0)),
        "last_judge_failure": meter.get("last_failure"),
        "scores": dict(sorted(meter.get("scores", {}).items())),
    }


async def _reports(log: EventLog, tenant: TenantId | None) -> list[dict[str, Any]]:
    policy = GradingSettings.from_env().policy()
    return [
        report(who, meter, policy.ceiling_for(str(who)))
        for who, key, meter in await log.scan_kind("meter")
        if key == "grading" and (tenant is None or who == tenant)
    ]


async def health_command(data_dir: Path, tenant: TenantId | None) -> int:
    """Print each tenant's grading health as JSON (a list, one object per tenant).

    Raises:
        AssayError: no tournament state where this environment points, or it cannot be read.
    """
    async with stage_state(data_dir, PG_SCHEMA, "nothing was graded there") as log:
        found = await _reports(log, tenant)
    print(json.dumps(found, indent=2))
    return 0
