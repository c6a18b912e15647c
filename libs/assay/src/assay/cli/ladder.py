"""`assay ladder`: each workflow's versions on the promotion ladder, and the held-out gap.

Per tenant and workflow: the allocation (generation, current version, every
live challenger with its rung, share, ladder and standing — the first one also in
the single-challenger fields — and what holds it — the drift check, or
the tenant's judge whose scheduled calibration found it disagreeing with the
verifier, whose last finding is shown beside it, or the task mix: ingest's last
window against the reference mix, each feature's PSI, and whether that drift holds
promotion until `assay ladder ack-drift WORKFLOW` acknowledges it), what grading the
workflow's runs cost beside what it decided (judge calls and dollars, in all and per
promotion decided), then every version
the aggregate has seen — the rungs it climbed and how its time ended, its
verifier pass rate on selection and on held-out tasks, and for a challenger its
win rate (draws excluded) on both; each with the gap, selection minus held-out
(§12.5: a widening gap is the overfitting alarm). Read from the decide and
aggregate stages' state (and ingest's, for the task mix): the data directory's SQLite
files, or, with `ASSAY_DATABASE_URL` set, the schemas it can read.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from assay.cli.drift import summary
from assay.cli.logs import stage_state
from assay.kernel.ids import TenantId
from assay.kernel.spend import MICRO
from assay.messages.loop import complete_allocation
from assay.store.ports import EventLog

RUNGS = {
    "default": ["shadow", "trial"],
    "resourced": ["shadow", "canary", "ramp"],
}
"""Each ladder's rungs below current, in the order they are climbed (none is skipped)."""


def rate(hits: int, total: int) -> float | None:
    """A proportion, None without a denominator."""
    return hits / total if total else None


def gap(selection: float | None, held_out: float | None) -> float | None:
    """Selection minus held-out: positive when held-out tasks do worse."""
    if selection is None or held_out is None:
        return None
    return selection - held_out


def win_rate(record: dict[str, Any] | None) -> float | None:
    """Wins over decisive comparisons (draws carry no evidence either way)."""
    if not record:
        return None
    wins = int(record["judge_wins"]) + int(record["verifier_wins"])
    losses = int(record["judge_losses"]) + int(record["verifier_losses"])
    return rate(wins, wins + losses)


def path(
    decision: dict[str, Any] | None, ladder: str, rung: str | None, current: bool
) -> list[str]:
    """The rungs a version climbed and where it is now: `current`, `replaced` (it was
    current once), `rejected` or `rolled_back`."""
    rungs = RUNGS[ladder]

    def upto(r: str | None) -> list[str]:
        return rungs[: rungs.index(r) + 1] if r in rungs else []

    if decision is not None:
        outcome = str(decision.get("outcome", "promoted" if decision["accepted"] else "rejected"))
        if outcome != "promoted":
            return [*upto(decision.get("rung")), outcome]
        return [*upto(decision.get("rung")), "current", *([] if current else ["replaced"])]
    if rung is not None:
        return upto(rung) or [rung]
    return ["current"] if current else ["current", "replaced"]


def grading_cost(tallies: list[dict[str, Any]], decided: int) -> dict[str, Any]:
    """What grading a workflow's runs cost beside what it bought: judge calls billed and
    their dollars over every version, and per promotion decided (a version promoted,
    rejected or rolled back: the ladder's unit of value). Tallies kept before grading
    cost was counted count as none."""
    calls = sum(int(t.get("judge_calls") or 0) for t in tallies)
    usd = sum(int(t.get("judge_micro_usd") or 0) for t in tallies) / MICRO
    return {
        "judge_calls": calls,
        "judge_usd": usd,
        "promotions_decided": decided,
        "judge_calls_per_decision": calls / decided if decided else None,
        "judge_usd_per_decision": usd / decided if decided else None,
    }


def version_report(version: str, tally: dict[str, Any]) -> dict[str, Any]:
    """One version's pass and win rates on selection and held-out tasks, with the gaps."""
    held = tally.get("held_out") or {}
    runs, passes = int(tally["runs"]), int(tally["passes"])
    held_runs, held_passes = int(held.get("runs", 0)), int(held.get("passes", 0))
    sel_pass = rate(passes - held_passes, runs - held_runs)
    held_pass = rate(held_passes, held_runs)
    sel_win, held_win = win_rate(tally.get("record")), win_rate(held.get("record"))
    return {
        "version": version,
        "runs": {"selection": runs - held_runs, "held_out": held_runs},
        "pass_rate": {
            "selection": sel_pass,
            "held_out": held_pass,
            "gap": gap(sel_pass, held_pass),
        },
        "win_rate": {"selection": sel_win, "held_out": held_win, "gap": gap(sel_win, held_win)},
        "record": tally.get("record"),
        "capped": {
            "selection": int((tally.get("record") or {}).get("capped", 0)),
            "held_out": int((held.get("record") or {}).get("capped", 0)),
        },
    }


async def reports(
    decide: EventLog, aggregate: EventLog, tenant: TenantId | None, ingest: EventLog | None = None
) -> list[dict[str, Any]]:
    """One report per (tenant, workflow) the decide stage holds an allocation for (with its
    task-mix watch from `ingest`'s state, when given)."""
    tallies: dict[tuple[TenantId, str], dict[str, Any]] = defaultdict(dict)
    for who, version, doc in await aggregate.scan_kind("version"):
        tallies[(who, str(doc["workflow_id"]))][version] = doc
    decisions = {(who, v): doc for who, v, doc in await decide.scan_kind("decision")}
    standings: dict[tuple[TenantId, str], dict[str, dict[str, Any]]] = defaultdict(dict)
    for who, key, doc in await decide.scan_kind("ladder"):  # `<workflow>/<version>`
        workflow, _, version = key.rpartition("/")
        standings[(who, workflow)][version] = doc
    judged = {who: doc for who, _, doc in await decide.scan_kind("judge_health")}
    holds = {(who, w): doc for who, w, doc in await decide.scan_kind("task_mix_hold")}
    mixes = {} if ingest is None else {(w, k): d for w, k, d in await ingest.scan_kind("task_mix")}
    out = []
    for who, workflow, alloc in sorted(
        await decide.scan_kind("allocation"), key=lambda r: (str(r[0]), r[1])
    ):
        if tenant is not None and who != tenant:
            continue
        alloc = complete_allocation(alloc)  # several challengers, or the one in its fields
        ladder = alloc.get("ladder") or "default"
        stood = standings[(who, workflow)]
        live = {
            str(c["version"]): {
                "version": str(c["version"]),
                "rung": _value(c["rung"]),
                "ladder": _value(c.get("ladder") or "default"),
                "share": alloc["shares"][c["version"]],
                "standing": stood.get(str(c["version"])),
            }
            for c in alloc["challengers"]
        }
        seen = tallies[(who, workflow)]
        order = sorted(
            set(seen)
            | {v for (t, v), d in decisions.items() if t == who and d["workflow_id"] == workflow},
        )
        versions = []
        for v in order:
            tally = seen.get(v) or {"runs": 0, "passes": 0}
            decision = decisions.get((who, v))
            mine = live.get(v)
            climbed = str((decision or {}).get("ladder") or (mine or {}).get("ladder") or "default")
            live_rung = mine["rung"] if mine else None
            versions.append(
                {
                    **version_report(v, tally),
                    "current": v == alloc["current"],
                    "path": path(decision, climbed, live_rung, v == alloc["current"]),
                    "decision": None
                    if decision is None
                    else {k: decision[k] for k in ("outcome", "reason", "trigger", "rung", "llr")},
                }
            )
        out.append(
            {
                "tenant": str(who),
                "workflow": workflow,
                "generation": alloc["generation"],
                "current": alloc["current"],
                "challenger": alloc.get("challenger"),
                "rung": _value(alloc.get("rung")),
                "share": alloc.get("challenger_share", 0.0),
                "ladder": _value(ladder),
                "standing": live[alloc["challenger"]]["standing"]
                if alloc.get("challenger")
                else None,
                "challengers": list(live.values()),
                "judge_calibration": _calibration(judged.get(who)),
                "grading_cost": grading_cost(
                    list(seen.values()),
                    sum(1 for v in versions if v["decision"] is not None),
                ),
                "task_mix": summary(mixes.get((who, workflow)), holds.get((who, workflow))),
                "versions": versions,
            }
        )
    return out


def _value(v: Any) -> Any:
    """An enum's value; anything else as it is."""
    return getattr(v, "value", v)


def _calibration(doc: dict[str, Any] | None) -> dict[str, Any] | None:
    """The tenant's last judge calibration decide heard of (None: none yet)."""
    if doc is None:
        return None
    keep = ("judge", "agreement", "judged", "order_inconsistency_rate", "source")
    return {k: doc[k] for k in keep}


async def read_reports(data_dir: Path, tenant: TenantId | None) -> list[dict[str, Any]]:
    """The reports from the data directory, or from Postgres with `ASSAY_DATABASE_URL` set.

    Raises:
        AssayError: no decide or aggregate state where this environment points.
    """
    missing = "no workflow was registered there"
    async with (
        stage_state(data_dir, "decide", missing) as decide,
        stage_state(data_dir, "aggregate", missing) as aggregate,
        stage_state(data_dir, "ingest", missing) as ingest,
    ):
        return await reports(decide, aggregate, tenant, ingest)


async def ladder_command(data_dir: Path, tenant: TenantId | None) -> int:
    """Print each workflow's ladder report as JSON (a list)."""
    print(json.dumps(await read_reports(data_dir, tenant), indent=2))
    return 0
