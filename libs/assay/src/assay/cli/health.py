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
from collections import Counter, defaultdict
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


def merged(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """A tenant's meter, from its documents (one per partition): counts summed, today's
    calls over the documents of the latest day, the last failure of that day's."""
    day = max(str(d.get("day", "")) for d in shards)
    out: dict[str, Any] = {"day": day, "calls_today": 0, "last_failure": None}
    for d in sorted(shards, key=lambda d: str(d.get("day", ""))):
        if d.get("day") == day:
            out["calls_today"] += int(d.get("calls_today", 0))
            out["last_failure"] = d.get("last_failure") or out["last_failure"]
        for k in ("calls_total", "order_checked", "order_inconsistent", "judge_failures"):
            out[k] = out.get(k, 0) + int(d.get(k, 0))
        for k in ("by_purpose", "scores"):
            out[k] = dict(Counter(out.get(k, {})) + Counter(d.get(k, {})))
    return out


async def _reports(log: EventLog, tenant: TenantId | None) -> list[dict[str, Any]]:
    policy = GradingSettings.from_env().policy()
    shards: dict[TenantId, list[dict[str, Any]]] = defaultdict(list)
    for who, key, meter in await log.scan_kind("meter"):
        if key.startswith("grading") and (tenant is None or who == tenant):
            shards[who].append(meter)
    return [
        report(who, merged(docs), policy.ceiling_for(str(who)))
        for who, docs in sorted(shards.items(), key=lambda kv: str(kv[0]))
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
