"""The §15 signals in embedded mode: one `/metrics` for the process, read as Prometheus
reads it, while a backlog builds and drains, while a challenger's shadow runs are
judged against current's, and after a scheduled calibration round measured the judge
against the verifier."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from assay.bus import RESULTS, TASKS, WORKFLOWS
from assay.kernel import tenant_id
from assay.messages import MESSAGES, RunResult, TaskSubmitted, WorkflowRegistered, open_envelope
from assay.record import StateKey
from assay.runtime import Embedded
from assay.runtime.settings import AssaySettings
from assay.workflow import WorkflowDef, from_document
from tests.signal_names import SECTION_15

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TENANT = tenant_id("5e1a2b3c-4d5e-4f60-8a7b-9c0d1e2f3a4b")
TASK_COUNT = 6
WORKFLOW = from_document(
    {
        "id": "signals",
        "steps": [
            {"id": "solve", "kind": "model", "prompt": "What is {{ task.question }}?"},
            {
                "id": "answer",
                "kind": "tool",
                "tool": "extract_number",
                "args": {"text": "{{ steps.solve.output }}"},
            },
        ],
        "verifiers": [
            {"id": "correct", "kind": "exact", "step": "answer", "expected": "{{ task.answer }}"}
        ],
    }
)

CALIBRATED = from_document(
    {
        "id": "calibrated",
        "steps": [
            {
                "id": "answer",
                "kind": "tool",
                "tool": "extract_number",
                "args": {"text": "the number is {{ task.number }}"},
            }
        ],
        "verifiers": [
            {"id": "correct", "kind": "exact", "step": "answer", "expected": "{{ task.answer }}"}
        ],
    }
)
"""A workflow whose verdict the task decides (no model): one task run with the right
answer and with a wrong one makes the tenant's calibration pair."""
CALIBRATION = {"ASSAY_CALIBRATION_INTERVAL_S": "3600", "ASSAY_GRADING_ORDER_CHECK": "1"}
"""Calibration on a schedule, and every pairwise comparison asked again in the other
order (so the judged round's order checks are all counted)."""


def judged_version(prompt: str) -> WorkflowDef:
    return from_document(
        {
            "id": "judged",
            "steps": [
                {"id": "solve", "kind": "model", "prompt": prompt},
                {
                    "id": "answer",
                    "kind": "tool",
                    "tool": "extract_number",
                    "args": {"text": "{{ steps.solve.output }}"},
                },
            ],
            # Always passes: a challenger run meets its reference in one outcome class, so
            # the judge (not the verifier) decides, and is asked in both orders.
            "verifiers": [{"id": "ran", "kind": "regex", "step": "answer", "pattern": ".*"}],
        }
    )


JUDGED = (
    judged_version("What is {{ task.question }}?"),
    judged_version("Compute {{ task.question }}."),
)
JUDGED_TASKS = 3


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(port: int) -> Samples:
    async with httpx.AsyncClient() as client:
        response = await client.get(f"http://127.0.0.1:{port}/metrics")
    assert response.status_code == 200
    for family in text_string_to_metric_families(response.text):
        EXPORTED.update(s.name for s in family.samples)
        EXPORTED.add(family.name + ("_total" if family.type == "counter" else ""))
        FAMILIES.add(_base(family.name))
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def total(samples: Samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def result_count(rt: Embedded) -> int:
    found = 0
    for partition in range(rt.partitions):
        for m in await rt.bus.fetch(RESULTS, partition, 0, 10_000, 0.0):
            env = open_envelope(m.value)
            found += isinstance(
                MESSAGES.decode(env.type, env.schema_version, env.payload), RunResult
            )
    return found


EXPORTED: set[str] = set()
"""Metric family names the embedded run's scrapes saw (for the dashboard test below)."""
FAMILIES: set[str] = set()
"""The same families by their base names (a counter without `_total`, and without the
`_created` series the client adds beside it)."""


async def test_embedded_signals_show_a_backlog_drain_and_every_run_move(tmp_path: Path) -> None:
    settings = AssaySettings.from_env(CALIBRATION)
    async with Embedded(tmp_path / "data", partitions=4, settings=settings) as rt:
        status = await rt.serve_status(0)
        try:
            rt.start()
            definition = WORKFLOW.model_dump(mode="json", by_alias=True)
            registered = WorkflowRegistered(tenant=TENANT, definition=definition)
            await rt.publish(WORKFLOWS, registered, TENANT, idem=WORKFLOW.version)

            async def routed() -> bool:
                key = StateKey(TENANT, "allocation", WORKFLOW.id)
                return await rt.logs["ingest"].get(key) is not None

            await until(routed, "the workflow to be routed")
            await rt.stop()  # a backlog builds while no stage consumes
            for n in range(TASK_COUNT):
                task = TaskSubmitted(
                    tenant=TENANT,
                    workflow_id=WORKFLOW.id,
                    idempotency_key=f"task-{n}",
                    input={"question": f"{n} + 1", "answer": str(n + 1)},
                )
                await rt.publish(TASKS, task, TENANT, idem=f"task-{n}")
            backlog = await scrape(status.port)
            assert total(backlog, "assay_stage_lag", stage="ingest", topic=TASKS) == TASK_COUNT
            assert total(backlog, "assay_stage_lag", stage="execute") == 0

            rt.start()

            async def all_results() -> bool:
                return await result_count(rt) == TASK_COUNT

            await until(all_results, "every result")

            async def drained() -> bool:
                return total(await scrape(status.port), "assay_stage_lag") == 0

            await until(drained, "every stage's lag to drain")
            after = await scrape(status.port)
            judged = await judged_round(rt, status.port)
            calibrated = await calibration_round(rt, status.port)
        finally:
            await status.close()

    labels = {"tenant": str(TENANT), "workflow": "signals", "version": WORKFLOW.version}
    assert total(after, "assay_run_transitions_total", state="running", **labels) == TASK_COUNT
    assert total(after, "assay_run_transitions_total", state="verifying", **labels) == TASK_COUNT
    assert total(after, "assay_run_transitions_total", stage="execute") >= 2 * TASK_COUNT
    assert total(after, "assay_run_transitions_total", stage="tournament", state="ungraded") == 6
    # One version, nothing to compare with: every run is ungraded, and says why.
    assert total(after, "assay_runs_ungraded_total", reason="no_reference", **labels) == TASK_COUNT
    assert total(after, "assay_runs_ungraded_total", **labels) == TASK_COUNT, "no other reason"
    assert total(after, "assay_runs_graded_total") == 0
    handled = total(after, "assay_handler_seconds_count", stage="ingest", type="TaskSubmitted")
    assert handled == TASK_COUNT
    assert total(after, "assay_handler_seconds_count", stage="verify") == TASK_COUNT
    e2e = total(after, "assay_task_to_result_seconds_count", tenant=str(TENANT))
    assert e2e == TASK_COUNT
    assert total(after, "assay_task_to_result_seconds_sum", tenant=str(TENANT)) > 0
    assert not any("run_id" in dict(ls) for _, ls in after), "no run ids in labels"
    # The challenger's shadow runs are judged against current's, each in both orders.
    challenger = {"tenant": str(TENANT), "workflow": "judged", "version": JUDGED[1].version}
    assert total(judged, "assay_runs_graded_total", score="relative", **challenger) == JUDGED_TASKS
    checks = total(judged, "assay_judge_order_checks_total", tenant=str(TENANT), workflow="judged")
    assert checks == JUDGED_TASKS
    # The stub judge cannot tell the pair's two episodes apart: a draw both ways.
    judge = {"tenant": str(TENANT)}
    assert total(calibrated, "assay_judge_verifier_agreement", **judge) == 0.0
    assert total(calibrated, "assay_judge_calibration_orderings", **judge) == 2
    # the hold's thresholds, exported so the alert compares against decide's settings
    assert total(calibrated, "assay_judge_calibration_min_agreement") == 0.7
    assert total(calibrated, "assay_judge_calibration_min_judged") == 4
    missing = [name for name in SECTION_15 if name not in EXPORTED]
    assert not missing, f"§15 signals not on the process's /metrics: {missing}"


async def register(rt: Embedded, wf: WorkflowDef) -> None:
    """Register `wf` and wait until ingest routes its workflow to it (as current or as
    the challenger)."""
    definition = wf.model_dump(mode="json", by_alias=True)
    await rt.publish(
        WORKFLOWS, WorkflowRegistered(tenant=TENANT, definition=definition), TENANT, idem=wf.version
    )

    async def routed() -> bool:
        alloc = await rt.logs["ingest"].get(StateKey(TENANT, "allocation", wf.id))
        return alloc is not None and wf.version in (alloc["current"], alloc.get("challenger"))

    await until(routed, f"{wf.id} {wf.version[:8]} to be routed")


async def judged_round(rt: Embedded, port: int) -> Samples:
    """Run `JUDGED_TASKS` tasks on a workflow with a challenger in shadow; scrape once
    every shadow run is graded."""
    for wf in JUDGED:
        await register(rt, wf)
    for n in range(JUDGED_TASKS):
        task = TaskSubmitted(
            tenant=TENANT,
            workflow_id=JUDGED[0].id,
            idempotency_key=f"judged-{n}",
            input={"question": f"{n} + 3"},
        )
        await rt.publish(TASKS, task, TENANT, idem=f"judged-{n}")
    found: Samples = {}
    challenger = {"workflow": "judged", "version": JUDGED[1].version}

    async def graded() -> bool:
        nonlocal found
        found = await scrape(port)
        ended = total(found, "assay_runs_graded_total", **challenger)
        return ended + total(found, "assay_runs_ungraded_total", **challenger) >= JUDGED_TASKS

    await until(graded, "the challenger's shadow runs to be graded")
    return found


async def calibration_round(rt: Embedded, port: int) -> Samples:
    """Run one task of `CALIBRATED` right and wrong; scrape once the round that pair
    falls due for has been measured."""
    definition = CALIBRATED.model_dump(mode="json", by_alias=True)
    registered = WorkflowRegistered(tenant=TENANT, definition=definition)
    await rt.publish(WORKFLOWS, registered, TENANT, idem=CALIBRATED.version)

    async def routed() -> bool:
        return (
            await rt.logs["ingest"].get(StateKey(TENANT, "allocation", CALIBRATED.id)) is not None
        )

    await until(routed, "the calibrated workflow to be routed")
    for n, answer in enumerate(("5", "6")):  # one task: a pass, then a fail
        task = TaskSubmitted(
            tenant=TENANT,
            workflow_id=CALIBRATED.id,
            idempotency_key=f"calibrate-{n}",
            input={"number": "5", "answer": answer},
            task_key="five",
        )
        await rt.publish(TASKS, task, TENANT, idem=f"calibrate-{n}")
    found: Samples = {}

    async def measured() -> bool:
        nonlocal found
        found = await scrape(port)
        return any(name == "assay_judge_verifier_agreement" for name, _ in found)

    await until(measured, "the calibration round's agreement on /metrics")
    return found


# -- the dashboard and the alerts name only what is exported --------------------------------

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def _selectors(node: object) -> Iterator[str]:
    """Metric names a parsed PromQL expression selects."""
    if isinstance(node, promql_parser.VectorSelector):
        if node.name:
            yield node.name
        return
    for attr in ("expr", "lhs", "rhs", "vector_selector", "param", "args"):
        child = getattr(node, attr, None)
        for item in child if isinstance(child, list) else [child]:
            if item is not None and not isinstance(item, str | int | float):
                yield from _selectors(item)


def _expressions() -> list[tuple[str, str]]:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    found = [
        (f"alert {rule['alert']}", rule["expr"])
        for group in rules["groups"]
        for rule in group["rules"]
    ]
    dashboard = json.loads((DEPLOY / "grafana" / "assay.json").read_text())
    found += [
        (f"panel {panel['title']!r}", target["expr"])
        for panel in dashboard["panels"]
        for target in panel["targets"]
    ]
    return found


def test_alert_rules_are_well_formed() -> None:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    names = [rule["alert"] for group in rules["groups"] for rule in group["rules"]]
    assert len(names) == len(set(names)), "alert names are unique"
    for group in rules["groups"]:
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
            assert rule["labels"]["severity"] in {"page", "warn"}
            assert rule["annotations"]["summary"]
            if "for" in rule:
                assert re.fullmatch(r"\d+[smhd]", rule["for"]), rule["alert"]


async def test_every_expression_parses_and_names_an_exported_metric(tmp_path: Path) -> None:
    if not EXPORTED:  # run alone: scrape a pipeline first
        await test_embedded_signals_show_a_backlog_drain_and_every_run_move(tmp_path)
    for where, expr in _expressions():
        parsed = promql_parser.parse(expr)  # raises on a malformed expression
        names = set(_selectors(parsed))
        assert names, f"{where} selects no metric"
        assert names <= EXPORTED, f"{where}: {sorted(names - EXPORTED)} not exported"


def test_a_malformed_expression_is_caught() -> None:
    with pytest.raises(ValueError, match="parenthesis"):
        promql_parser.parse("sum by (stage (rate(assay_stage_lag[5m]))")


# -- the metrics page names what is exported, and every §15 signal --------------------------

ROOT = DEPLOY.parent
METRICS_PAGE = ROOT / "docs" / "operations" / "metrics.md"
SUFFIXES = re.compile(r"_(total|count|sum|bucket|created)$")


def _base(name: str) -> str:
    return SUFFIXES.sub("", name)


def _documented(text: str) -> set[str]:
    """Metric names in backticks, by base name; `assay_x_*` stands for a prefix."""
    return {_base(n) for n in re.findall(r"`(assay_[a-z_]+\*?)(?:\{[^`]*\})?`", text)}


def _signal_table(text: str) -> str:
    start = text.index("| signal (DESIGN §14) |")
    return text[start : text.index("\n\n", start)]


def _source() -> str:
    roots = [ROOT / "libs" / "assay" / "src", *(ROOT / "services").glob("*/src")]
    return "\n".join(f.read_text() for r in roots for f in sorted(r.rglob("*.py")))


async def test_the_metrics_page_names_every_exported_metric_and_only_those(
    tmp_path: Path,
) -> None:
    if not FAMILIES:  # run alone: scrape a pipeline first
        await test_embedded_signals_show_a_backlog_drain_and_every_run_move(tmp_path)
    text = METRICS_PAGE.read_text()
    documented = _documented(text)
    prefixes = {n.removesuffix("*") for n in documented if n.endswith("*")}

    def named(family: str) -> bool:
        return family in documented or any(family.startswith(p) for p in prefixes)

    assert not [f for f in sorted(FAMILIES) if not named(f)], "exported, not on the page"
    source = _source()
    for name in sorted(documented):
        if name.endswith("*"):
            assert any(f.startswith(name[:-1]) for f in FAMILIES), f"{name}: nothing exported"
        else:  # exported by the embedded run, or only when configured (sandbox suspension)
            assert name in FAMILIES or f'"{name}"' in source, f"{name} is on the page only"
    table = _documented(_signal_table(text))
    missing = sorted({_base(n) for n in SECTION_15} - table)
    assert not missing, f"§15 families missing from the page's signal table: {missing}"


def test_a_metric_the_code_does_not_export_is_caught_on_the_page() -> None:
    page = "| x | `assay_no_such_signal_total`, `assay_replay_*` |"
    assert _documented(page) == {"assay_no_such_signal", "assay_replay_*"}
    assert '"assay_no_such_signal"' not in _source()
