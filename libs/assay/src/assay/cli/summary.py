"""The demo's final table, read from the stages' own state: what ran, what the judge
cost, each version's climb up the ladder, and the held-out gap (§12.5).

The judge's figures are the tournament stage's grading meter, merged as `assay grade
health` merges it: one source of truth, so the two never disagree."""

from __future__ import annotations

from typing import Any

from assay.cli.health import merged
from assay.cli.ladder import reports
from assay.kernel.ids import TenantId
from assay.messages import RunResult
from assay.record import StateKey
from assay.runtime.embedded import Embedded
from assay.store.ports import EventLog

ENDINGS = {"rejected": "REJECTED", "rolled_back": "ROLLED BACK", "promoted": "PROMOTED"}


def _comparisons(record: dict[str, Any]) -> int:
    keys = ("judge_wins", "judge_losses", "draws", "verifier_wins", "verifier_losses")
    return sum(int(record[k]) for k in keys)


async def summarise(
    rt: Embedded,
    tenant: TenantId,
    labels: dict[str, str],
    results: dict[str, list[RunResult]],
    seconds: float,
) -> dict[str, Any]:
    """Everything the table shows, as data."""
    decide, ingest = rt.logs["decide"], rt.logs["ingest"]
    found = await reports(decide, rt.logs["aggregate"], tenant, rt.logs["ingest"])
    report = found[0] if found else None
    shards = [
        d for k, d in await rt.logs["tournament"].scan(tenant, "meter") if k.startswith("grading")
    ]
    meter = merged(shards) if shards else {}
    tasks = dict(await ingest.scan(tenant, "task"))
    versions = []
    for v in report["versions"] if report else []:
        accepted = await decide.get(StateKey(tenant, "accepted", v["version"]))
        record = (accepted or {}).get("record") or v["record"] or {}
        versions.append(
            {
                **v,
                "label": labels.get(v["version"], v["version"][:12]),
                "comparisons_to_accept": _comparisons(record) if accepted else None,
            }
        )
    versions.sort(key=lambda v: (v["version"] not in labels, v["label"]))  # v1, v2, ...
    runs = sum(v["runs"]["selection"] + v["runs"]["held_out"] for v in versions)
    verifier = sum(
        int((v["record"] or {}).get(k, 0))
        for v in versions
        for k in ("verifier_wins", "verifier_losses")
    )
    current = report["current"] if report else None
    workflow = report["workflow"] if report else None
    return {
        "slow_loop": await _slow_loop(decide, tenant, workflow, labels) if workflow else None,
        "runs": runs,
        "seconds": round(seconds, 2),
        "tasks": len(results),
        "held_out_tasks": sum(1 for key in results if tasks.get(key, {}).get("held_out")),
        "duplicate_results": sum(len(r) - 1 for r in results.values()),
        "judge_calls": int(meter.get("calls_total", 0)),
        "judge_calls_by_purpose": dict(sorted(meter.get("by_purpose", {}).items())),
        "judge_failures": int(meter.get("judge_failures", 0)),
        "judge_failures_by_purpose": dict(sorted(meter.get("failures_by_purpose", {}).items())),
        "verifier_decided": verifier,
        "versions": versions,
        "current": labels.get(current, (current or "")[:12]) if current else None,
        "current_version": current,
    }


async def _slow_loop(
    decide: EventLog, tenant: TenantId, workflow: str, labels: dict[str, str]
) -> str | None:
    """What the slow loop did last: a proposal waiting for approval, or why none was made."""
    waiting = await decide.get(StateKey(tenant, "open_proposal", workflow))
    if waiting is not None:
        doc = await decide.get(StateKey(tenant, "proposal", waiting["proposal_id"]))
        assert doc is not None
        return (
            f"proposal {doc['proposal_id']} ({doc['rationale']}) awaits "
            f"`assay proposals approve {doc['proposal_id']}`"
        )
    idle = await decide.get(StateKey(tenant, "unproposed", workflow))
    if idle is not None:
        after = labels.get(idle["after"], idle["after"][:12])
        return f"no proposal after {after}: {idle['reason']}"
    return None


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _gap(x: float | None) -> str:
    return "" if x is None else f" ({x * 100:+.1f})"


def _pair(rates: dict[str, float | None]) -> str:
    return f"{_pct(rates['selection'])} / {_pct(rates['held_out'])}{_gap(rates['gap'])}"


def _by_purpose(counts: dict[str, int]) -> str:
    return ", ".join(f"{purpose} {n}" for purpose, n in counts.items() if n)


def judge_calls_line(s: dict[str, Any]) -> str:
    """`<answered> answered (<by purpose>)`, then `; <failed> failed (<by purpose>)` when
    any call failed: the figures `assay grade health` reports as `judge_calls_total` and
    `judge_failures`."""
    line = f"{s['judge_calls']} answered"
    if s["judge_calls"]:
        line += f" ({_by_purpose(s['judge_calls_by_purpose'])})"
    if s["judge_failures"]:
        line += f"; {s['judge_failures']} failed ({_by_purpose(s['judge_failures_by_purpose'])})"
    return line


def print_summary(s: dict[str, Any]) -> None:
    """The table, then one line per decision saying why."""
    challengers = [v for v in s["versions"] if v["decision"] is not None]
    first = challengers[0] if challengers else None
    sprt = "pending"
    if first is not None:
        sprt = f"{ENDINGS[first['decision']['outcome']]} {first['label']}"
    rows = [
        ("tasks with a result", f"{s['tasks']} ({s['held_out_tasks']} held out)"),
        ("runs (incl. shadow)", str(s["runs"])),
        ("judge calls", judge_calls_line(s)),
        ("verifier-decided comparisons", str(s["verifier_decided"])),
        ("SPRT decision", sprt),
        (
            "comparisons to decide",
            "-"
            if first is None or first["comparisons_to_accept"] is None
            else str(first["comparisons_to_accept"]),
        ),
        ("current version", f"{s['current']} ({(s['current_version'] or '')[:12]})"),
        ("ladder policy", s.get("ladder", "-")),
        ("wall time", f"{s['seconds']}s"),
    ]
    width = max(len(k) for k, _ in rows)
    print("Assay demo")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    table = [("version", "ladder", "runs", "pass rate: selection / held-out (gap)", "win rate")]
    for v in s["versions"]:
        table.append(
            (
                v["label"],
                " -> ".join(step.replace("_", " ") for step in v["path"]),
                str(v["runs"]["selection"] + v["runs"]["held_out"]),
                _pair(v["pass_rate"]),
                _pair(v["win_rate"]) if v["record"] else "-",
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    print()
    for row in table:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    for v in challengers:
        d = v["decision"]
        where = d["rung"] or "registration"
        print(f"  {v['label']}: {ENDINGS[d['outcome']]} from {where}: {d['reason']}")
    if s.get("slow_loop"):
        print(f"  slow loop: {s['slow_loop']}")
