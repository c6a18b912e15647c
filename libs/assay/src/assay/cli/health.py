"""`assay grade health`: each tenant's grading meter, from the tournament stage's state.

Per tenant: judge calls the endpoint billed today against the tenant's ceiling,
judge calls that answered and judge calls that failed, each by purpose
(compare — with its order checks —, screen, tournament, attempts, rollout) and
the failed calls the endpoint still billed, the judge's health — the
order-inconsistency rate on sampled order checks and both-order tournament
pairs, and the last failure — and how grading ended, by score kind
and `Ungraded` by reason (§11.6: a tenant whose loop never engages must see a
stated reason, not a silence). Beside it, replay's spend (§12.4): the tenant's
replay ceilings, the model calls, tokens and dollars its shadow runs and replay
candidates reserved today (their worst cases) and the shadow runs admitted and cut
(the ingest stage's meter), and what the shadow runs whose
grading ended spent (runs, model calls, tokens). And the judge's scheduled
calibration (§11): each judge model's last agreement with the verifier and order
inconsistency on the tenant's calibration set, the calls it spent today against
its budget, when the next round is due, and whether low agreement holds
promotion. Grading's spend today in the tournament's spend ledger — calls, tokens
and dollars spent and held by reservations in flight, against the tenant's ceilings
— and, per workflow, what grading cost beside what it decided (judge calls and
dollars per promotion decided, from the aggregate and decide stages' state, when it
is there). Where the state is: with `ASSAY_DATABASE_URL` set, the `tournament`,
`ingest`, `aggregate` and `decide` schemas in Postgres; otherwise the data
directory's SQLite files of those stages.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from contextlib import AsyncExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from assay.cli.ladder import reports as ladder_reports
from assay.cli.logs import stage_state
from assay.grading.calibration_policy import CalibrationPolicy
from assay.grading.replay import meter_of, reserved_today
from assay.kernel.ids import TenantId
from assay.kernel.spend import MICRO, SpendDay, SpendLimit
from assay.messages import Purpose
from assay.runtime.settings import AssaySettings
from assay.store.ports import EventLog

PG_SCHEMA = "tournament"
GRADING = Purpose.GRADING.value
"""The tournament ledger's purpose of judge calls that grade runs."""
INGEST_LOG = "ingest.sqlite"
INGEST_SCHEMA = "ingest"


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
        "judge_failures": int(meter.get("judge_failures", 0)),
        "judge_failures_by_purpose": dict(sorted(meter.get("failures_by_purpose", {}).items())),
        "judge_failures_billed": int(meter.get("failures_billed", 0)),
        "last_judge_failure": meter.get("last_failure"),
        "order_checked": checked,
        "order_inconsistent": inconsistent,
        "order_inconsistency_rate": inconsistent / checked if checked else None,
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
        for k in (
            "calls_total",
            "order_checked",
            "order_inconsistent",
            "judge_failures",
            "failures_billed",
        ):
            out[k] = out.get(k, 0) + int(d.get(k, 0))
        for k in ("by_purpose", "failures_by_purpose", "scores"):
            out[k] = dict(Counter(out.get(k, {})) + Counter(d.get(k, {})))
    return out


def replay_report(
    reserved: dict[str, Any] | None,
    spent: list[dict[str, Any]],
    limit: SpendLimit,
    today: str,
) -> dict[str, Any]:
    """One tenant's replay spend: reserved at admission (ingest's meter, for `today`;
    None where that state is not there) beside its ceilings, and spent by its shadow
    runs whose grading ended (`spent`: one document per run)."""
    admitted = None if reserved is None else meter_of(today, reserved)

    def of(key: str) -> int | None:
        return None if admitted is None else int(admitted[key])

    held = None if admitted is None else reserved_today(admitted)
    done_today = [d for d in spent if d["day"] == today]
    return {
        "calls_ceiling": limit.calls,
        "tokens_ceiling": limit.tokens,
        "usd_ceiling": limit.usd,
        "calls_reserved_today": of("calls_today"),
        "tokens_reserved_today": None if held is None else held.tokens,
        "usd_reserved_today": None if held is None else held.usd,
        "runs_admitted_today": of("runs_today"),
        "runs_cut_today": of("cut_today"),
        "runs_cut_total": of("cut_total"),
        "runs_graded_today": len(done_today),
        "model_calls_today": sum(int(d["model_calls"]) for d in done_today),
        "tokens_today": sum(int(d["tokens"]) for d in done_today),
        "model_calls_total": sum(int(d["model_calls"]) for d in spent),
        "tokens_total": sum(int(d["tokens"]) for d in spent),
    }


def calibration_report(
    policy: CalibrationPolicy,
    tenant: TenantId,
    schedule: dict[str, Any] | None,
    judges: list[dict[str, Any]],
    today: str,
) -> dict[str, Any]:
    """One tenant's scheduled calibration: its schedule and spend, each judge model's
    last finding, and why promotion is held by it (None: it is not)."""
    latest = max(judges, key=lambda j: int(j["due_ms"]), default=None)
    held = None if latest is None else policy.hold(latest["agreement"], int(latest["judged"]))
    spent = int(schedule["calls_today"]) if schedule and schedule["day"] == today else 0
    return {
        "scheduled": policy.scheduled,
        "interval_s": policy.interval_s,
        "calls_today": spent,
        "calls_budget": policy.budget_for(str(tenant)),
        "next_due": _iso(schedule["next_due_ms"]) if schedule else None,
        "min_agreement": policy.min_agreement,
        "promotion_held": held if policy.scheduled else None,
        "judges": [
            {
                "judge": j["judge"],
                "calibrated_due": _iso(j["due_ms"]),
                "source": j["source"],
                "pairs": j["pairs"],
                "judged": j["judged"],
                "agreed": j["agreed"],
                "agreement": j["agreement"],
                "order_inconsistency_rate": j["order_inconsistency_rate"],
                "failures": j["failures"],
            }
            for j in sorted(judges, key=lambda j: str(j["judge"]))
        ],
    }


def spend_report(day: SpendDay, limit: SpendLimit, today: str) -> dict[str, Any]:
    """One tenant's grading spend today (UTC) from the ledger, beside its ceilings."""
    return {
        "day": today,
        "calls": day.spent.calls,
        "tokens": day.spent.tokens,
        "usd": day.spent.usd,
        "held": {"calls": day.held.calls, "tokens": day.held.tokens, "usd": day.held.usd},
        "ceiling": {
            "calls": limit.calls,
            "tokens": limit.tokens,
            "usd": None if limit.micro_usd is None else limit.micro_usd / MICRO,
        },
    }


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(int(ms) / 1000, UTC).isoformat()


async def _reports(
    log: EventLog,
    ingest: EventLog | None,
    tenant: TenantId | None,
    workflows: dict[str, list[dict[str, Any]]] | None = None,
) -> list[dict[str, Any]]:
    settings = AssaySettings.from_env()
    policy, replay = settings.grading, settings.replay
    reserved: dict[TenantId, dict[str, Any]] = {}
    if ingest is not None:
        reserved = {who: m for who, k, m in await ingest.scan_kind("meter") if k == "replay"}
    spent: dict[TenantId, list[dict[str, Any]]] = defaultdict(list)
    for who, _, doc in await log.scan_kind("replay"):
        spent[who].append(doc)
    today = datetime.now(UTC).date().isoformat()
    shards: dict[TenantId, list[dict[str, Any]]] = defaultdict(list)
    for who, key, doc in await log.scan_kind("meter"):
        if key.startswith("grading") and (tenant is None or who == tenant):
            shards[who].append(doc)
    meters = {who: merged(docs) for who, docs in shards.items()}
    schedules = {who: doc for who, _, doc in await log.scan_kind("calibration_round")}
    judges: dict[TenantId, list[dict[str, Any]]] = defaultdict(list)
    for who, _, doc in await log.scan_kind("judge_agreement"):
        judges[who].append(doc)
    calibrated = {w for w in (*schedules, *judges) if tenant is None or w == tenant}
    tenants = sorted(set(meters) | calibrated, key=str)
    ledger = {who: await log.spend_of(who, GRADING, today) for who in tenants}
    return [
        {
            **report(who, meters.get(who, {}), policy.ceiling_for(str(who))),
            "grading_spend": spend_report(ledger[who], policy.limit_for(str(who)), today),
            "workflows": None if workflows is None else workflows.get(str(who), []),
            "replay": replay_report(
                reserved.get(who, {}) if ingest is not None else None,
                spent[who],
                replay.limit_for(str(who)),
                today,
            ),
            "calibration": calibration_report(
                settings.calibration, who, schedules.get(who), judges[who], today
            ),
        }
        for who in tenants
    ]


async def health_command(data_dir: Path, tenant: TenantId | None) -> int:
    """Print each tenant's grading health as JSON (a list, one object per tenant).

    Raises:
        AssayError: no tournament state where this environment points, or it cannot be read.
    """
    async with AsyncExitStack() as stack:
        log = await stack.enter_async_context(
            stage_state(data_dir, PG_SCHEMA, "nothing was graded there")
        )
        ingest: EventLog | None = None  # replay's admission meter, when ingest ran here
        if AssaySettings.from_env().database.url or (data_dir / INGEST_LOG).is_file():
            ingest = await stack.enter_async_context(
                stage_state(data_dir, INGEST_SCHEMA, "no task was submitted there")
            )
        found = await _reports(log, ingest, tenant, await _workflow_costs(stack, data_dir, tenant))
    print(json.dumps(found, indent=2))
    return 0


async def _workflow_costs(
    stack: AsyncExitStack, data_dir: Path, tenant: TenantId | None
) -> dict[str, list[dict[str, Any]]] | None:
    """Each tenant's workflows with what grading them cost beside what it decided (the
    ladder's `grading_cost`); None when the decide and aggregate state is not here."""
    here = all((data_dir / f"{stage}.sqlite").is_file() for stage in ("decide", "aggregate"))
    if not (AssaySettings.from_env().database.url or here):
        return None
    decide = await stack.enter_async_context(stage_state(data_dir, "decide", "no decide state"))
    aggregate = await stack.enter_async_context(
        stage_state(data_dir, "aggregate", "no aggregate state")
    )
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in await ladder_reports(decide, aggregate, tenant):
        out[r["tenant"]].append({"workflow": r["workflow"], **r["grading_cost"]})
    return out
