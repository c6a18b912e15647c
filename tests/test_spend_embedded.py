"""Spend, complete, in embedded mode end to end: against a loopback chat-completions
gateway with prices declared, every kind of model call — the agent's work and shadow
runs, the judge grading and calibrating, the proposer drafting — reaches `assay.usage`
with its tenant, run (none for calibration and the proposer), purpose, tokens and
dollars at the configured prices; the tournament's and decide's ledgers hold what their
purposes spent; `assay grade health` and `assay ladder` report grading's dollars as the
messages do; and every record re-folds identically."""

from __future__ import annotations

import contextlib
import io
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from assay.bus import AGGREGATES, GRADED, TASKS, USAGE
from assay.cli.health import health_command
from assay.cli.ladder import read_reports
from assay.cli.rebuild import rebuild
from assay.engine import Prices, solve
from assay.kernel import RunId
from assay.kernel.scores import WinRecord
from assay.kernel.spend import Spend
from assay.messages import (
    FailureEvidence,
    Purpose,
    RunGraded,
    TaskSubmitted,
    UsageRecorded,
    VariantAggregate,
    VerifierResult,
)
from assay.record import StateKey
from assay.runtime import Embedded
from assay.runtime.settings import AssaySettings
from assay.workflow import WorkflowDef, from_document
from assay_ingest.stage import task_id_for
from libs.assay.tests.chat_endpoint import ChatServer, Reply, Seen, completion, json_reply
from tests.test_calibration_embedded import TENANT, on_bus, register, until
from tests.test_signals_embedded import scrape, total

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "workflows"
PRICES = Prices(prompt_per_mtok=2.0, completion_per_mtok=10.0)
PROMPT_TOKENS, COMPLETION_TOKENS = 300, 20


def example(name: str) -> WorkflowDef:
    return from_document(yaml.safe_load((EXAMPLES / name).read_text()))


V1, V2, V3 = example("arith-v1.yaml"), example("arith-v2.yaml"), example("arith-v3.yaml")


def respond(seen: Seen) -> Reply:
    """The agent's arithmetic, the judge's verdicts and the proposer's draft, each billed
    the same tokens."""
    messages = seen.body["messages"]
    system = messages[0]["content"] if messages[0]["role"] == "system" else ""
    if not system:
        text = str(solve(messages[-1]["content"]))
    elif system.startswith("You improve"):
        definition = V3.model_dump(mode="json", by_alias=True)
        text = json.dumps({"rationale": "show the working", "definition": definition})
    else:
        text = '{"verdict": "A"}'
    body = completion(
        text, prompt_tokens=PROMPT_TOKENS, completion_tokens=COMPLETION_TOKENS, model="gw"
    )
    return json_reply(body)


def task(n: int, answer: str) -> TaskSubmitted:
    return TaskSubmitted(
        tenant=TENANT,
        workflow_id=V1.id,
        idempotency_key=f"task-{n}",
        input={"question": "2 + 3", "answer": answer},
        task_key="five",
    )


TASK_ID = task_id_for(task(0, "5"))
"""Every task here is the same one: its reference is the first current run verified."""


def rejected() -> VariantAggregate:
    """The challenger loses: decide rejects it and asks the proposer for the next one."""
    failure = FailureEvidence(
        run_id=RunId("01HZX3V8Q6M9T2K4R7W1Y5N001"),
        task_id=TASK_ID,
        workflow_version=V2.version,
        failed_checks=[
            VerifierResult(
                verifier="correct",
                kind="exact",
                verifier_version="1",
                passed=False,
                evidence="expected 5, got 6",
            )
        ],
    )
    return VariantAggregate(
        tenant=TENANT,
        workflow_id=V2.id,
        workflow_version=V2.version,
        baseline_version=V1.version,
        record=WinRecord(judge_losses=6, verifier_losses=3),
        runs=9,
        passes=3,
        failures=[failure],
    )


async def test_every_purpose_reaches_assay_usage_with_its_dollars(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {
        "ASSAY_MODEL_URL": "",
        "ASSAY_MODEL_NAME": "gw",
        "ASSAY_MODEL_PRICE_PROMPT_PER_MTOK": str(PRICES.prompt_per_mtok),
        "ASSAY_MODEL_PRICE_COMPLETION_PER_MTOK": str(PRICES.completion_per_mtok),
        "ASSAY_CALIBRATION_INTERVAL_S": "3600",
        "ASSAY_CALIBRATION_MIN_JUDGED": "2",
        "ASSAY_GRADING_USD_PER_DAY": "5",
    }
    data = tmp_path / "data"
    with ChatServer(respond) as gateway:
        env["ASSAY_MODEL_URL"] = gateway.base_url
        settings = AssaySettings.from_env(env)
        async with Embedded(data, partitions=4, settings=settings) as rt:
            rt.start()
            await register(rt, V1)

            async def routed() -> bool:
                return (
                    await rt.logs["ingest"].get(StateKey(TENANT, "allocation", V1.id)) is not None
                )

            await until(routed, "the workflow to be routed")
            # work runs: a pass, then a fail. The pass goes first and becomes the task's
            # reference, so the challenger's passing shadow runs are compared by the judge
            # (against the fail, the verifier would decide, and grading would spend nothing)
            await rt.publish(TASKS, task(0, "5"), TENANT, idem="task-0")
            reference = StateKey(TENANT, "reference", f"{TASK_ID}/{V1.version}")

            async def referenced() -> bool:
                return await rt.logs["tournament"].get(reference) is not None

            await until(referenced, "the passing run to become the task's reference")
            await rt.publish(TASKS, task(1, "6"), TENANT, idem="task-1")
            await register(rt, V2)

            async def challenged() -> bool:
                doc = await rt.logs["decide"].get(StateKey(TENANT, "allocation", V1.id))
                return doc is not None and doc.get("challenger") == V2.version

            await until(challenged, "the challenger to be registered")
            for n in (2, 3):  # each task a work run and the challenger's shadow run
                await rt.publish(TASKS, task(n, "5"), TENANT, idem=f"task-{n}")

            async def all_spent() -> bool:
                usage = [u for u in await on_bus(rt, USAGE) if isinstance(u, UsageRecorded)]
                return {Purpose.GRADING, Purpose.CALIBRATION, Purpose.SHADOW} <= {
                    u.purpose for u in usage
                }

            await until(all_spent, "grading, calibration and shadow spend")
            await rt.publish(AGGREGATES, rejected(), TENANT, idem="rejected")

            async def drafted() -> bool:
                usage = await on_bus(rt, USAGE)
                return any(u.purpose is Purpose.PROPOSER for u in usage)

            await until(drafted, "the proposer's draft to be metered")
            tournament, decide = rt.logs["tournament"], rt.logs["decide"]

            async def settled() -> bool:
                """Both shadow runs graded, and every call the ledgers hold on the bus."""
                usage = [u for u in await on_bus(rt, USAGE) if isinstance(u, UsageRecorded)]
                graded = [g for g in await on_bus(rt, GRADED) if isinstance(g, RunGraded)]
                row = await tournament.spend_of(TENANT, "grading", _today())
                grading = [u for u in usage if u.purpose is Purpose.GRADING]
                shadows = [g for g in graded if g.run.purpose is Purpose.SHADOW]
                return len(shadows) >= 2 and row.spent.calls == len(grading) and not row.held.calls

            await until(settled, "the shadow runs' grading to be settled and published")
            usage = [u for u in await on_bus(rt, USAGE) if isinstance(u, UsageRecorded)]
            graded = [g for g in await on_bus(rt, GRADED) if isinstance(g, RunGraded)]
            grading_row = await tournament.spend_of(TENANT, "grading", _today())
            proposer_row = await decide.spend_of(TENANT, "proposer", _today())
            status = await rt.serve_status(0)
            try:
                metrics = await scrape(status.port)
            finally:
                await status.close()

    one_call = PRICES.cost(PROMPT_TOKENS, COMPLETION_TOKENS)
    # every purpose this workload spends on (replay is a candidate matrix's: none here)
    assert {u.purpose for u in usage} == set(Purpose) - {Purpose.REPLAY}
    for u in usage:
        assert u.tenant == TENANT
        assert (u.prompt_tokens, u.completion_tokens) == (PROMPT_TOKENS, COMPLETION_TOKENS)
        assert u.cost_usd == pytest.approx(one_call)
        served_a_run = u.purpose not in (Purpose.CALIBRATION, Purpose.PROPOSER)
        assert (u.run_id is not None) == served_a_run, u
    by = {p: [u for u in usage if u.purpose is p] for p in Purpose}
    grading_usd = sum(u.cost_usd for u in by[Purpose.GRADING])
    assert grading_row.held == proposer_row.held == Spend()
    assert grading_row.spent.calls == len(by[Purpose.GRADING])
    assert grading_row.spent.usd == pytest.approx(grading_usd, abs=1e-6)
    assert proposer_row.spent.calls == len(by[Purpose.PROPOSER]) == 1
    assert sum(g.judge_cost_usd for g in graded) == pytest.approx(grading_usd)
    # §15 spend on /metrics: each purpose's dollars and tokens, as committed to assay.usage
    tenant = str(TENANT)
    for purpose, calls in by.items():
        p = purpose.value
        spent = total(metrics, "assay_spend_usd_total", tenant=tenant, purpose=p)
        assert spent == pytest.approx(one_call * len(calls)), purpose
        for kind, each in (("prompt", PROMPT_TOKENS), ("completion", COMPLETION_TOKENS)):
            tokens = total(metrics, "assay_model_tokens_total", purpose=p, kind=kind)
            assert tokens == each * len(calls), (purpose, kind)

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert await health_command(data, TENANT) == 0
    (health,) = json.loads(out.getvalue())
    spend: dict[str, Any] = health["grading_spend"]
    assert spend["usd"] == pytest.approx(grading_usd, abs=1e-6)
    assert spend["ceiling"]["usd"] == 5.0
    (report,) = await read_reports(data, TENANT)
    cost = report["grading_cost"]
    assert cost["judge_usd"] == pytest.approx(grading_usd, abs=1e-6)
    assert cost["promotions_decided"] == 1  # the challenger, rejected
    assert cost["judge_usd_per_decision"] == pytest.approx(grading_usd, abs=1e-6)
    assert health["workflows"] == [{"workflow": V1.id, **cost}]
    with contextlib.redirect_stdout(io.StringIO()):
        assert await rebuild(data, check=True) == 0


def _today() -> str:
    return datetime.now(UTC).date().isoformat()
