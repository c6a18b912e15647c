"""`assay demo`: the whole loop in one process, resumable after a crash.

Registers v1 (becomes current) and v2 (becomes the challenger, replayed in
shadow), submits the example tasks, follows `assay.results` with a progress
bar until every task has its result and every run is graded, then prints a
summary read from the stages' own state.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from assay.bus.topics import RESULTS, TASKS, WORKFLOWS
from assay.cli.tasks import read_tasks
from assay.grading.sprt import SprtPolicy
from assay.kernel.errors import AssayError
from assay.kernel.ids import TenantId
from assay.kernel.schema import Versioned, one_line
from assay.messages import MESSAGES, RunResult, TaskSubmitted, WorkflowRegistered, open_envelope
from assay.runtime.embedded import Embedded, sprt_from_env
from assay.workflow import WorkflowDef, load_workflow

DEMO_TENANT = TenantId(uuid.uuid5(uuid.NAMESPACE_URL, "assay:demo"))
IN_FLIGHT = 32
"""Tasks the demo keeps awaiting a result at once."""


def _examples() -> Path:
    """The repository's `examples/` directory (the demo's default inputs)."""
    here = Path(__file__).resolve()  # `assay` is a namespace package: no files("assay") path
    for parent in here.parents:
        if (parent / "examples" / "workflows").is_dir():
            return parent / "examples"
    raise AssayError("cannot find the examples directory; pass --tasks and --workflows")


class _Bar:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.t0 = total, enabled, time.monotonic()

    def show(self, done: int, note: str = "") -> None:
        if not self.enabled:
            return
        width = 32
        fill = int(width * done / max(self.total, 1))
        rate = done / max(time.monotonic() - self.t0, 1e-9)
        sys.stderr.write(
            f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} results "
            f"{rate:5.1f}/s {note:<28}"
        )
        sys.stderr.flush()

    def end(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


async def _wait_for(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await cond():
        if time.monotonic() > deadline:
            raise AssayError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def demo(
    data_dir: Path,
    *,
    tasks: Path | None,
    workflows: list[Path] | None,
    limit: int | None,
    progress: bool,
    sprt: dict[str, float] | None = None,
) -> int:
    """Run the demo; return 0 when every task has exactly one result.

    `sprt` overrides fields of the sequential test's policy (else `ASSAY_SPRT_*`).
    """
    try:
        policy = SprtPolicy.model_validate({**sprt_from_env().model_dump(), **(sprt or {})})
    except ValidationError as exc:
        raise AssayError(f"invalid SPRT policy: {one_line(exc)}") from exc
    if workflows is None:
        workflows = [_examples() / "workflows" / f"arith-v{n}.yaml" for n in (1, 2)]
    v1_path, v2_path = workflows
    v1, v2 = load_workflow(v1_path), load_workflow(v2_path)
    if v1.id != v2.id:
        raise AssayError(f"the two workflows must share an id ({v1.id!r} != {v2.id!r})")
    todo = read_tasks(tasks or _examples() / "tasks" / "arith.jsonl", DEMO_TENANT, v1.id)
    todo = todo[:limit] if limit else todo
    keys = {t.idempotency_key for t in todo}
    t0 = time.monotonic()
    async with Embedded(data_dir, sprt=policy) as rt:
        rt.start()
        await _register(rt, v1, v2)
        bar = _Bar(len(keys), progress)
        results = await _follow_results(rt, todo, bar)
        bar.end()
        await _wait_for(lambda: _settled(rt), 120, "every run to be graded")
        summary = await _summary(rt, v1, v2, results, time.monotonic() - t0)
    _print_summary(summary)
    dupes = summary["duplicate_results"]
    return 0 if len(results) == len(keys) and not dupes else 1


async def _register(rt: Embedded, v1: WorkflowDef, v2: WorkflowDef) -> None:
    ingest, decide = rt.logs["ingest"], rt.logs["decide"]
    from assay.record import StateKey

    async def allocation() -> dict[str, Any] | None:
        return await ingest.get(StateKey(DEMO_TENANT, "allocation", v1.id))

    for wf, ready in (
        (v1, lambda a: a is not None),
        (v2, lambda a: a is not None and (v2.version in (a["current"], a.get("challenger")))),
    ):
        msg = WorkflowRegistered(
            tenant=DEMO_TENANT, definition=wf.model_dump(mode="json", by_alias=True)
        )
        await rt.publish(WORKFLOWS, msg, DEMO_TENANT, idem=wf.version)

        async def done(ready: Any = ready) -> bool:
            if await decide.get(StateKey(DEMO_TENANT, "decision", v2.version)) is not None:
                return True
            return bool(ready(await allocation()))

        await _wait_for(done, 30, f"registration of {wf.version[:12]}")


async def _follow_results(
    rt: Embedded, todo: list[TaskSubmitted], bar: _Bar
) -> dict[str, list[RunResult]]:
    """Submit tasks with at most `IN_FLIGHT` awaiting a result, like a producer that
    paces itself, and collect every result. Routing follows the allocation as it
    changes, so after a promotion the old version stops receiving tasks."""
    keys = {t.idempotency_key for t in todo}
    results: dict[str, list[RunResult]] = {}
    offsets = dict.fromkeys(range(rt.partitions), 0)
    seen_ids: set[str] = set()
    queue = list(todo)
    in_flight: set[str] = set()
    while len(results) < len(keys):
        got = 0
        for p in range(rt.partitions):
            for m in await rt.bus.fetch(RESULTS, p, offsets[p], 500, 0.0 if got else 0.01):
                offsets[p] = m.offset + 1
                env = open_envelope(m.value)
                if env.tenant != DEMO_TENANT or env.id in seen_ids:
                    continue  # a relay re-publish after a crash: same id, same fact
                seen_ids.add(env.id)
                res = MESSAGES.decode(env.type, env.schema_version, env.payload)
                assert isinstance(res, RunResult)
                if res.idempotency_key in keys:
                    results.setdefault(res.idempotency_key, []).append(res)
                    in_flight.discard(res.idempotency_key)
                    got += 1
        batch: list[tuple[str, Versioned, TenantId, str]] = []
        while queue and len(in_flight) < IN_FLIGHT:
            task = queue.pop(0)
            if task.idempotency_key not in results:  # done before a restart: not resent
                in_flight.add(task.idempotency_key)
                batch.append((TASKS, task, DEMO_TENANT, task.idempotency_key))
        if batch:
            await rt.publish_many(batch)
        bar.show(len(results))
        if not got and not batch:
            await asyncio.sleep(0.02)
    return results


async def _settled(rt: Embedded) -> bool:
    spawned = sum(len(doc["runs"]) for _, doc in await rt.logs["ingest"].scan(DEMO_TENANT, "task"))
    scored = len(await rt.logs["tournament"].scan(DEMO_TENANT, "scored"))
    return scored >= spawned


async def _summary(
    rt: Embedded,
    v1: WorkflowDef,
    v2: WorkflowDef,
    results: dict[str, list[RunResult]],
    seconds: float,
) -> dict[str, Any]:
    from assay.record import StateKey

    versions = dict(await rt.logs["aggregate"].scan(DEMO_TENANT, "version"))
    scored = await rt.logs["tournament"].scan(DEMO_TENANT, "scored")
    decision = await rt.logs["decide"].get(StateKey(DEMO_TENANT, "decision", v2.version))
    alloc = await rt.logs["decide"].get(StateKey(DEMO_TENANT, "allocation", v1.id))
    runs = sum(v["runs"] for v in versions.values())
    record = (versions.get(v2.version) or {}).get("record") or {}
    label: dict[str, str] = {v1.version: "v1", v2.version: "v2"}
    return {
        "runs": runs,
        "seconds": round(seconds, 2),
        "tasks": len(results),
        "duplicate_results": sum(len(r) - 1 for r in results.values()),
        "pass_rate": {
            label.get(k, k[:12]): {
                "runs": v["runs"],
                "passed": v["passes"],
                "rate": round(v["passes"] / v["runs"], 3),
            }
            for k, v in versions.items()
            if v["runs"]
        },
        "judge_calls": sum(doc["judge_calls"] for _, doc in scored),
        "verifier_decided": record.get("verifier_wins", 0) + record.get("verifier_losses", 0),
        "record": record,
        "decision": None
        if decision is None
        else {
            "accepted": decision["accepted"],
            "reason": decision["reason"],
            "comparisons": sum(
                decision["record"][k]
                for k in ("judge_wins", "judge_losses", "draws", "verifier_wins", "verifier_losses")
            ),
        },
        "current": label.get(alloc["current"], alloc["current"][:12]) if alloc else None,
        "current_version": alloc["current"] if alloc else None,
    }


def _print_summary(s: dict[str, Any]) -> None:
    d = s["decision"]
    rows = [
        ("tasks with a result", str(s["tasks"])),
        ("runs (incl. shadow)", str(s["runs"])),
        *(
            (f"pass rate {k}", f"{v['rate']:.1%} ({v['passed']}/{v['runs']})")
            for k, v in sorted(s["pass_rate"].items())
        ),
        ("judge calls", str(s["judge_calls"])),
        ("verifier-decided comparisons", str(s["verifier_decided"])),
        (
            "SPRT decision",
            "pending" if d is None else ("PROMOTED v2" if d["accepted"] else "REJECTED v2"),
        ),
        ("comparisons to decide", "-" if d is None else str(d["comparisons"])),
        ("current version", f"{s['current']} ({(s['current_version'] or '')[:12]})"),
        ("wall time", f"{s['seconds']}s"),
    ]
    width = max(len(k) for k, _ in rows)
    print("Assay demo")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    if d is not None:
        print(f"  ({d['reason']})")
