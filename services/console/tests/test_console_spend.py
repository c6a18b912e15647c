"""The spend and judge health page: model calls produced onto `assay.usage` and a
calibration round onto `assay.aggregates`, folded by the console stage, read back by
purpose against the ceilings of the settings, one tenant at a time; bad input names
the problem; the page draws its charts and escapes what a judge's name holds. The same
sums from Postgres."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from assay.bus.topics import AGGREGATES, USAGE
from assay.devstack import Service
from assay.devstack.postgres import scratch_database
from assay.kernel.ids import MessageId, RunId, TenantId
from assay.kernel.schema import Versioned
from assay.messages import JudgePurpose, Purpose, UsageRecorded
from assay.messages.calibration import JudgeCalibrated
from assay.runtime.embedded import Embedded
from assay.runtime.settings import AssaySettings
from assay.store import CommitBatch
from assay.store.postgres import PostgresEventLog
from assay.store.sqlite import SqliteEventLog
from assay_console.access import Access
from assay_console.app import create_app
from assay_console.reads import ConsoleReads, PostgresRunsTable, SqliteRunsTable
from assay_console.spend import CallSeen, usage_stream
from assay_console.stage import CONSOLE_EVENTS, CONSOLE_TABLES, fold_console
from services.console.tests.console_seed import HOSTILE, TENANT_A, TENANT_B, until_folded

TOKENS = f"{TENANT_A}=token-a,{TENANT_B}=token-b"
A = {"authorization": "Bearer token-a"}
B = {"authorization": "Bearer token-b"}
ADMIN = {"authorization": "Bearer token-admin"}
RUN = RunId("01M8K8SHFQ0JTFFYGMB5GF83Q4")
pytestmark = pytest.mark.asyncio(loop_scope="module")


def call(
    tenant: TenantId,
    purpose: Purpose,
    cost: float,
    *,
    failed: bool = False,
    judge: JudgePurpose | None = None,
) -> UsageRecorded:
    return UsageRecorded(
        tenant=tenant,
        run_id=None if purpose is Purpose.CALIBRATION else RUN,
        purpose=purpose,
        model="m",
        prompt_tokens=30,
        completion_tokens=10,
        cost_usd=cost,
        judge_purpose=judge,
        failed=failed,
    )


CALLS = [
    *(call(TENANT_A, Purpose.WORK, 0.01) for _ in range(3)),
    call(TENANT_A, Purpose.GRADING, 0.002, judge=JudgePurpose.COMPARE),
    call(TENANT_A, Purpose.GRADING, 0.002, judge=JudgePurpose.COMPARE, failed=True),
    call(TENANT_A, Purpose.SHADOW, 0.01),
    call(TENANT_A, Purpose.CALIBRATION, 0.001, judge=JudgePurpose.COMPARE),
    *(call(TENANT_B, Purpose.WORK, 0.5) for _ in range(5)),
]
ROUND = JudgeCalibrated(
    tenant=TENANT_A,
    judge=HOSTILE,
    due_ms=1_764_624_000_000,
    source="verified_runs",
    pairs=10,
    judged=20,
    agreed=15,
    draws=1,
    failures=0,
    checked=10,
    inconsistent=2,
    agreement=0.75,
    order_inconsistency_rate=0.2,
    model_calls=20,
    cost_usd=0.02,
)
SETTINGS = AssaySettings.model_validate(
    {
        "grading": {"calls_per_day": 100, "ceilings": f"{TENANT_A}=2"},
        "calibration": {"calls_per_day": 50, "min_agreement": 0.8},
        "replay": {"usd_per_day": 0.5},
    }
)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reads(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ConsoleReads]:
    data = tmp_path_factory.mktemp("spend")
    async with Embedded(data, stages=("console",), partitions=2) as rt:
        items: list[tuple[str, Versioned, TenantId, str]] = [
            (USAGE, c, c.tenant, f"call-{n}") for n, c in enumerate(CALLS)
        ]
        items.append((AGGREGATES, ROUND, TENANT_A, "round-1"))
        await rt.publish_many(items)
        rt.start()
        await until_folded(rt)
    store = data / "console.sqlite"
    log = await SqliteEventLog(store, CONSOLE_EVENTS, fold_console, tables=CONSOLE_TABLES).open()
    found = ConsoleReads(log, SqliteRunsTable(store))
    yield found
    await found.close()
    await log.close()


def client(reads: ConsoleReads, settings: AssaySettings | None = SETTINGS) -> httpx.AsyncClient:
    app = create_app(reads, Access.parse(TOKENS, "token-admin", "127.0.0.1"), None, settings)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://console")


def by_purpose(report: dict) -> dict[str, tuple[int, int, int, float]]:  # type: ignore[type-arg]
    out: dict[str, tuple[int, int, int, float]] = {}
    for b in report["buckets"]:
        calls, failed, tokens, usd = out.get(b["purpose"], (0, 0, 0, 0.0))
        out[b["purpose"]] = (
            calls + b["calls"],
            failed + b["failed"],
            tokens + b["prompt_tokens"] + b["completion_tokens"],
            round(usd + b["cost_usd"], 6),
        )
    return out


async def test_spend_by_purpose_against_the_ceilings(reads: ConsoleReads) -> None:
    async with client(reads) as c:
        report = (await c.get("/api/spend", headers=A)).json()
    assert report["bucket"] == "day"
    assert by_purpose(report) == {
        "work": (3, 0, 120, 0.03),
        "grading": (2, 1, 80, 0.004),
        "shadow": (1, 0, 40, 0.01),
        "calibration": (1, 0, 40, 0.001),
    }
    ceilings = {
        (c["purpose"], c["unit"]): (c["limit"], c["used_today"]) for c in report["ceilings"]
    }
    assert ceilings == {
        ("grading", "calls"): (2, 2),  # the tenant's own ceiling, reached
        ("shadow", "calls"): (None, 1),  # replay has no ceiling unless one is set
        ("shadow", "tokens"): (None, 40),
        ("shadow", "usd"): (0.5, 0.01),  # the dollar ceiling every tenant has here
        ("calibration", "calls"): (50, 1),
    }
    assert any("proposer" in note for note in report["notes"])


async def test_the_judges_calibration_rounds(reads: ConsoleReads) -> None:
    async with client(reads) as c:
        judge = (await c.get("/api/spend", headers=A)).json()["judge"]
    assert judge["min_agreement"] == 0.8
    (only,) = judge["rounds"]
    assert (only["agreement"], only["order_inconsistency_rate"]) == (0.75, 0.2)
    assert only["judge"] == HOSTILE


async def test_another_tenants_spend_is_not_reachable(reads: ConsoleReads) -> None:
    async with client(reads) as c:
        theirs = await c.get("/api/spend", headers=B, params={"tenant": str(TENANT_A)})
        assert theirs.status_code == 404
        own = (await c.get("/api/spend", headers=B)).json()
        named = await c.get("/api/spend", headers=ADMIN, params={"tenant": str(TENANT_B)})
    assert by_purpose(own) == {"work": (5, 0, 200, 2.5)}
    assert own["judge"]["rounds"] == []
    assert named.json()["buckets"] == own["buckets"]


async def test_hourly_buckets_sum_to_the_same(reads: ConsoleReads) -> None:
    async with client(reads) as c:
        daily = (await c.get("/api/spend", headers=A)).json()
        hourly = await c.get("/api/spend", headers=A, params={"days": 1, "bucket": "hour"})
    assert hourly.status_code == 200
    assert hourly.json()["bucket"] == "hour"
    assert by_purpose(hourly.json()) == by_purpose(daily)


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"days": "0"}, "days"),
        ({"days": "91"}, "days"),
        ({"days": "week"}, "days"),
        ({"bucket": "minute"}, "bucket"),
        ({"purpose": "work"}, "unknown parameter: purpose"),
    ],
)
async def test_bad_input_names_the_problem(
    reads: ConsoleReads, params: dict[str, str], named: str
) -> None:
    async with client(reads) as c:
        answer = await c.get("/api/spend", headers=A, params=params)
    assert answer.status_code == 400
    assert named in answer.json()["detail"]


async def test_without_the_settings_no_ceiling_is_shown_and_it_says_so(
    reads: ConsoleReads,
) -> None:
    async with client(reads, None) as c:
        report = (await c.get("/api/spend", headers=A)).json()
    assert report["ceilings"] == []
    assert any("settings" in note for note in report["notes"])
    assert report["judge"]["min_agreement"] is None


async def test_the_page_draws_the_charts_and_escapes_the_judges_name(reads: ConsoleReads) -> None:
    async with client(reads) as c:
        page = await c.get("/spend", headers=A)
        theirs = await c.get("/spend", headers=B, params={"tenant": str(TENANT_A)})
    assert page.status_code == 200
    for chart in ("spend-calls", "spend-tokens", "spend-usd", "judge"):
        assert f'class="time-chart {chart}"' in page.text
    assert 'data-name="grading"' in page.text  # its ceiling line on the calls chart
    assert HOSTILE not in page.text
    assert "&lt;script&gt;" in page.text
    assert theirs.status_code == 404


@pytest.mark.postgres
async def test_the_same_sums_from_postgres(postgres: Service, tmp_path: Path) -> None:
    schema = f"console_{uuid.uuid4().hex[:8]}"
    now_ms = int(datetime.now(UTC).timestamp() * 1000)
    with scratch_database(postgres, "assay_console") as dsn:
        log = await PostgresEventLog(
            dsn, schema, CONSOLE_EVENTS, fold_console, tables=CONSOLE_TABLES
        ).open()
        for n, c in enumerate(CALLS):
            event = CallSeen(call=f"call-{n}", at_ms=now_ms, call_usage=c)
            inbox = (c.tenant, MessageId(f"call-{n}"))
            await log.commit(
                CommitBatch(records=[(usage_stream(c.tenant, now_ms), event)], inbox=inbox)
            )
        pg = ConsoleReads(log, await PostgresRunsTable.connect(dsn, schema))
        try:
            report = await pg.spend(TENANT_A, 7, "day", SETTINGS)
            other = await pg.spend(TENANT_B, 1, "hour", SETTINGS)
        finally:
            await pg.close()
            await log.close()
    sums = by_purpose(report.model_dump(mode="json"))
    assert sums["work"] == (3, 0, 120, 0.03)
    assert sums["grading"] == (2, 1, 80, 0.004)
    assert by_purpose(other.model_dump(mode="json")) == {"work": (5, 0, 200, 2.5)}
