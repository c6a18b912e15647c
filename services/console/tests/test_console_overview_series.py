"""The overview over time (`/api/overview/series`, the overview page's charts): runs
with known creation and result times land in the right buckets, in both stores; the
latency percentiles are the nearest ranks; bad parameters name the problem; another
tenant's series is a 404 like everything else of it; and the page draws the charts."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from assay.devstack import Service
from assay.devstack.postgres import scratch_database
from assay.kernel import Lsn, RunState
from assay.kernel.ids import MessageId, RunId, TaskId, TenantId, run_id_from
from assay.kernel.scores import Ungraded, UngradedReason
from assay.messages import RunRef, RunResult, Usage
from assay.record import DocumentTable, Event, LogRecord, Patch
from assay.store import CommitBatch
from assay.store.postgres import PostgresEventLog
from assay.store.sqlite import SqliteEventLog
from assay_console.access import Access
from assay_console.app import create_app
from assay_console.overview_series import SeriesQuery, overview_series
from assay_console.reads import ConsoleReads, PostgresRunsTable, SqliteRunsTable
from assay_console.spend import USAGE_TABLE
from assay_console.stage import (
    CONSOLE_EVENTS,
    CONSOLE_TABLES,
    RUNS_TABLE,
    IndeterminateSeen,
    ResultSeen,
    RunSeen,
    StatusSeen,
    fold_console,
    run_stream,
)
from services.console.tests.console_seed import HOSTILE, T0_MS, TENANT_A, TENANT_B, run_ref

TOKENS = f"{TENANT_A}=token-a,{TENANT_B}=token-b"
A = {"authorization": "Bearer token-a"}
B = {"authorization": "Bearer token-b"}
ADMIN = {"authorization": "Bearer token-admin"}
S, MIN, HOUR = 1000, 60_000, 3_600_000
BASE = T0_MS // HOUR * HOUR
"""Start of bucket 2 of the asked window (six hours by hour, ending half an hour into
bucket 5)."""
END = BASE + 3 * HOUR + 30 * MIN
ADAPTERS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
ASKED = {
    "window": "6h",
    "bucket": "1h",
    "end": datetime.fromtimestamp(END / 1000, UTC).isoformat(),
}


def _ref(tenant: TenantId, created_ms: int, n: int) -> RunRef:
    base = run_ref(tenant, 0)
    run_id = RunId(run_id_from(created_ms, f"{tenant}:series:{n}"))
    return base.model_copy(update={"run_id": run_id, "task_id": TaskId(f"series-{n}")})


def _result(ref: RunRef, passed: bool) -> RunResult:
    return RunResult(
        tenant=ref.tenant,
        run_id=ref.run_id,
        task_id=ref.task_id,
        idempotency_key=ref.idempotency_key,
        workflow_id=ref.workflow_id,
        workflow_version=ref.workflow_version,
        status="ungraded",
        passed=passed,
        verification=[],
        score=Ungraded(reason=UngradedReason.NO_REFERENCE),
        usage=Usage(),
        termination="succeeded",
        held_out=False,
    )


def _run(
    tenant: TenantId, n: int, created_ms: int, result_ms: int | None, passed: bool | None
) -> list[Event]:
    """A run created at `created_ms`; verified when `passed` says; its result received at
    `result_ms` (None: no result)."""
    ref = _ref(tenant, created_ms, n)
    events: list[Event] = [RunSeen(run=ref, input={"n": n})]
    if passed is not None:
        state = RunState.VERIFIED_PASS if passed else RunState.VERIFIED_FAIL
        events.append(StatusSeen(run=ref, state=state))
    if result_ms is not None:
        events.append(ResultSeen(result=_result(ref, bool(passed)), at_ms=result_ms))
    return events


def seeded() -> dict[TenantId, list[list[Event]]]:
    """Tenant A's runs, bucket by bucket (bucket k starts at BASE + (k - 2) hours)."""
    a: list[list[Event]] = []
    # bucket 0: one run, passed, its result 10 s later
    a.append(_run(TENANT_A, 0, BASE - 2 * HOUR + MIN, BASE - 2 * HOUR + MIN + 10 * S, True))
    # bucket 1: a result of a run created before the window
    a.append(_run(TENANT_A, 1, BASE - 3 * HOUR, BASE - HOUR + S, False))
    # bucket 2: four runs, three pass; results 1, 2, 3 and 40 s after creation
    for k, (latency, passed) in enumerate([(1, True), (2, True), (3, True), (40, False)]):
        created = BASE + k * MIN
        a.append(_run(TENANT_A, 10 + k, created, created + latency * S, passed))
    # bucket 3: a run that failed, its result in bucket 5 (after 2 h 5 min)
    a.append(_run(TENANT_A, 20, BASE + HOUR + 5 * MIN, BASE + 3 * HOUR + 10 * MIN, False))
    # bucket 4: twenty runs, results 1..20 s after creation; all pass
    for k in range(20):
        created = BASE + 2 * HOUR + k * MIN
        a.append(_run(TENANT_A, 30 + k, created, created + (k + 1) * S, True))
    # bucket 5: a run whose result comes after the window's end
    a.append(_run(TENANT_A, 60, BASE + 3 * HOUR, END + MIN, True))
    # after the window: counted nowhere
    a.append(_run(TENANT_A, 61, END + MIN, END + 2 * MIN, True))
    # bucket 4: a result recorded before the console noted its time (ResultSeen v1)
    old = _run(TENANT_A, 70, BASE + 2 * HOUR + 30 * MIN, None, True)
    ref = _ref(TENANT_A, BASE + 2 * HOUR + 30 * MIN, 70)
    a.append([*old, ResultSeen(result=_result(ref, True))])
    b = [_run(TENANT_B, 0, BASE + MIN, BASE + 2 * MIN, False)]
    ref_b = _ref(TENANT_B, BASE + MIN, 0)
    b.append([IndeterminateSeen(run=ref_b, step="pay", attempt=1, tool="charge", reason="lost")])
    return {TENANT_A: a, TENANT_B: b}


def _run_of(event: Event) -> str:
    if isinstance(event, ResultSeen):
        return event.result.run_id
    assert isinstance(event, RunSeen | StatusSeen | IndeterminateSeen)
    return event.run.run_id


async def _commit_all(log: SqliteEventLog | PostgresEventLog) -> None:
    n = 0
    for tenant, runs in seeded().items():
        for events in runs:
            for event in events:
                run_id = _run_of(event)
                n += 1
                await log.commit(
                    CommitBatch(
                        records=[(run_stream(tenant, run_id), event)],
                        inbox=(tenant, MessageId(f"series-{n}")),
                    )
                )


@pytest.fixture(params=ADAPTERS)
async def client(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[httpx.AsyncClient]:
    log: SqliteEventLog | PostgresEventLog
    if request.param == "sqlite":
        store = tmp_path / "console.sqlite"
        log = await SqliteEventLog(
            store, CONSOLE_EVENTS, fold_console, tables=CONSOLE_TABLES
        ).open()
        await _commit_all(log)
        reads = ConsoleReads(log, SqliteRunsTable(store))
        async for c in _serve(reads):
            yield c
        await log.close()
        return
    postgres: Service = request.getfixturevalue("postgres")
    schema = f"console_{uuid.uuid4().hex[:8]}"
    with scratch_database(postgres, "assay_series") as dsn:
        log = await PostgresEventLog(
            dsn, schema, CONSOLE_EVENTS, fold_console, tables=CONSOLE_TABLES
        ).open()
        await _commit_all(log)
        reads = ConsoleReads(log, await PostgresRunsTable.connect(dsn, schema))
        async for c in _serve(reads):
            yield c
        await log.close()


async def _serve(reads: ConsoleReads) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(reads, Access.parse(TOKENS, "token-admin", "127.0.0.1"))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://console") as c:
        yield c
    await reads.close()


async def series(client: httpx.AsyncClient, **params: str) -> dict[str, Any]:
    response = await client.get("/api/overview/series", headers=A, params={**ASKED, **params})
    assert response.status_code == 200, response.text
    found: dict[str, Any] = response.json()
    return found


async def test_runs_and_results_land_in_their_buckets(client: httpx.AsyncClient) -> None:
    s = await series(client)
    assert (s["window"], s["bucket"]) == ("6h", "1h")
    assert s["since"] == datetime.fromtimestamp((BASE - 2 * HOUR) / 1000, UTC).isoformat().replace(
        "+00:00", "Z"
    )
    b = s["buckets"]
    assert [x["start"] for x in b] == [
        datetime.fromtimestamp((BASE + (k - 2) * HOUR) / 1000, UTC)
        .isoformat()
        .replace("+00:00", "Z")
        for k in range(6)
    ]
    assert [x["tasks_in"] for x in b] == [1, 0, 4, 1, 21, 1]
    assert [x["results_out"] for x in b] == [1, 1, 4, 0, 20, 1]
    assert [(x["passed"], x["verified"]) for x in b] == [
        (1, 1),
        (0, 0),
        (3, 4),
        (0, 1),
        (21, 21),
        (1, 1),
    ]
    assert [x["pass_rate"] for x in b] == [1.0, None, 0.75, 0.0, 1.0, 1.0]
    # a whole hour's results over 3600 s; the last bucket's over the half hour before `end`
    assert b[2]["throughput_per_s"] == round(4 / 3600, 6)
    assert b[5]["throughput_per_s"] == round(1 / 1800, 6)
    assert b[3]["throughput_per_s"] == 0.0


async def test_latency_percentiles_are_the_nearest_ranks(client: httpx.AsyncClient) -> None:
    b = (await series(client))["buckets"]
    assert (b[0]["latency_p50_ms"], b[0]["latency_p95_ms"]) == (10_000, 10_000)
    assert (b[1]["latency_p50_ms"], b[1]["latency_p95_ms"]) == (2 * HOUR + S, 2 * HOUR + S)
    # four results of 1, 2, 3, 40 s: rank 2 of 4 and rank 4 of 4
    assert (b[2]["latency_p50_ms"], b[2]["latency_p95_ms"]) == (2_000, 40_000)
    assert (b[3]["latency_p50_ms"], b[3]["latency_p95_ms"]) == (None, None)
    # twenty results of 1..20 s: rank 10 and rank 19
    assert (b[4]["latency_p50_ms"], b[4]["latency_p95_ms"]) == (10_000, 19_000)
    assert b[5]["latency_p50_ms"] == 2 * HOUR + 5 * MIN


async def test_the_default_window_is_a_day_by_hour_up_to_now(client: httpx.AsyncClient) -> None:
    response = await client.get("/api/overview/series", headers=A)
    s = response.json()
    assert (s["window"], s["bucket"], len(s["buckets"])) == ("24h", "1h", 24)
    end = datetime.fromisoformat(s["end"])
    assert abs((datetime.now(UTC) - end).total_seconds()) < 60
    by_minute = (await series(client, window="1h", bucket=""))["buckets"]
    assert len(by_minute) == 60


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"window": "2h"}, "window: '2h' is not one of 1h, 6h, 24h, 7d, 30d"),
        ({"bucket": "2m"}, "bucket: '2m' is not one of"),
        ({"window": "1h", "bucket": "1d"}, "bucket: 1d is longer than the window 1h"),
        ({"window": "30d", "bucket": "1m"}, "43200 buckets of the window 30d; at most 500"),
        ({"end": "yesterday"}, "end: 'yesterday' is not an ISO 8601 time"),
        ({"end": "1970-01-01T00:00:00Z"}, "end: '1970-01-01T00:00:00Z' is before"),
        ({"since": "2026-01-01"}, "unknown parameter: since"),
    ],
)
async def test_bad_parameters_name_the_problem(
    client: httpx.AsyncClient, params: dict[str, str], named: str
) -> None:
    response = await client.get("/api/overview/series", headers=A, params=params)
    assert response.status_code == 400
    assert named in response.json()["detail"]


async def test_another_tenants_series_is_a_404(client: httpx.AsyncClient) -> None:
    for path in ("/api/overview/series", "/overview/series"):
        response = await client.get(path, headers=B, params={"tenant": str(TENANT_A)})
        assert response.status_code == 404, path
    own = (await client.get("/api/overview/series", headers=B, params=ASKED)).json()
    assert [x["tasks_in"] for x in own["buckets"]] == [0, 0, 1, 0, 0, 0]
    unnamed = await client.get("/api/overview/series", headers=ADMIN)
    assert unnamed.status_code == 400
    named = await client.get(
        "/api/overview/series", headers=ADMIN, params={**ASKED, "tenant": str(TENANT_B)}
    )
    assert named.json()["tenant"] == str(TENANT_B)


async def test_a_hostile_parameter_is_escaped(client: httpx.AsyncClient) -> None:
    for path in ("/", "/overview/series"):
        response = await client.get(path, headers=A, params={"window": HOSTILE})
        assert response.status_code == 400
        assert "<script>" not in response.text
        assert "&lt;script&gt;" in response.text


def _dots(html: str, kind: str) -> dict[str, list[str]]:
    """Each series' data-values in the chart of class `kind`."""
    svg = re.search(rf'<svg class="time-chart {kind}".*?</svg>', html, re.S)
    assert svg is not None, kind
    return {
        name: re.findall(r'data-value="([^"]*)"', body)
        for name, body in re.findall(r'data-name="([^"]*)">(.*?)</g>', svg.group(0), re.S)
    }


async def test_the_page_draws_each_chart(client: httpx.AsyncClient) -> None:
    page = (await client.get("/", headers=A, params=ASKED)).text
    assert _dots(page, "overview-volume") == {
        "tasks in": ["1", "0", "4", "1", "21", "1"],
        "results out": ["1", "1", "4", "0", "20", "1"],
    }
    # no point where nothing was verified
    assert _dots(page, "overview-pass-rate") == {"pass rate": ["1", "0.75", "0", "1", "1"]}
    assert _dots(page, "overview-latency") == {
        "p50 s": ["10", "7201", "2", "10", "7500"],
        "p95 s": ["10", "7201", "40", "19", "7500"],
    }
    assert "data-poll" not in page.split('class="overview-series"')[1].split(">")[0]
    live = (await client.get("/", headers=A)).text
    assert 'data-poll="1" data-every="15000" data-src="/overview/series?tenant=' in live
    fragment = await client.get("/overview/series", headers=A, params=ASKED)
    assert _dots(fragment.text, "overview-throughput")["results/s"][2] == str(round(4 / 3600, 6))


async def test_a_non_zero_indeterminate_count_is_highlighted(
    client: httpx.AsyncClient,
) -> None:
    none = (await client.get("/", headers=A)).text
    assert '<dd class="indeterminate">0</dd>' in none
    assert "indeterminate alert" not in none
    some = (await client.get("/", headers=B)).text
    assert re.search(
        r'<dd class="indeterminate alert"><span class="marker"[^>]*>⚠</span> 1</dd>', some
    )


def test_a_result_recorded_before_its_time_was_noted_folds_as_it_did() -> None:
    """A stored ResultSeen v1 patches the row exactly as before (no `result_ms`), so
    `rebuild --check` of an earlier console store stays identical; v2 adds the time."""
    fixtures = Path(__file__).resolve().parent / "fixtures" / "events"
    v1 = CONSOLE_EVENTS.decode(
        "console.ResultSeen", 1, json.loads((fixtures / "console.ResultSeen.v1.json").read_text())
    )
    key = run_stream(TENANT_A, "run")
    (old,) = fold_console(LogRecord(key, Lsn(0), 1, 5, v1))
    assert isinstance(old, Patch)
    assert "result_ms" not in old.fields
    assert set(old.fields) == {"run_id", "passed", "status", "score_kind", "ungraded_reason"}
    assert isinstance(v1, ResultSeen)
    v2 = ResultSeen(result=v1.result, at_ms=1_234)
    (new,) = fold_console(LogRecord(key, Lsn(0), 2, 5, v2))
    assert isinstance(new, Patch)
    assert new.fields["result_ms"] == 1_234


@pytest.mark.parametrize(
    "adapter", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_a_console_store_of_before_result_times_opens_and_charts_new_results(
    adapter: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A console store made before `console_runs` had `result_ms` opens with it; the
    results that arrive from then on are charted."""
    before = DocumentTable(
        kind=RUNS_TABLE.kind,
        table=RUNS_TABLE.table,
        columns=tuple(c for c in RUNS_TABLE.columns if c.name != "result_ms"),
        indexes=tuple(i for i in RUNS_TABLE.indexes if "result_ms" not in i),
    )
    store = tmp_path / "console.sqlite"
    dsn = ""
    if adapter == "postgres":
        dsn = str(request.getfixturevalue("series_database"))
    schema = f"console_{uuid.uuid4().hex[:8]}"

    def opened(tables: tuple[DocumentTable, ...]) -> SqliteEventLog | PostgresEventLog:
        if adapter == "sqlite":
            return SqliteEventLog(store, CONSOLE_EVENTS, fold_console, tables=tables)
        return PostgresEventLog(dsn, schema, CONSOLE_EVENTS, fold_console, tables=tables)

    async def commit(log: SqliteEventLog | PostgresEventLog, n: int, events: list[Event]) -> None:
        for i, event in enumerate(events):
            run_id = _run_of(event)
            batch = CommitBatch(
                records=[(run_stream(TENANT_A, run_id), event)],
                inbox=(TENANT_A, MessageId(f"upgrade-{n}-{i}")),
            )
            await log.commit(batch)

    log = await opened((before, USAGE_TABLE)).open()
    await commit(log, 0, _run(TENANT_A, 0, BASE + MIN, None, True))
    await log.close()
    log = await opened(CONSOLE_TABLES).open()
    table: SqliteRunsTable | PostgresRunsTable = (
        SqliteRunsTable(store)
        if adapter == "sqlite"
        else await PostgresRunsTable.connect(dsn, schema)
    )
    try:
        await commit(log, 1, _run(TENANT_A, 1, BASE + 2 * MIN, BASE + 3 * MIN, True))
        q = SeriesQuery("6h", "1h", END)
        found = await overview_series(table, TENANT_A, q)
        assert [b.tasks_in for b in found.buckets] == [0, 0, 2, 0, 0, 0]
        assert [b.results_out for b in found.buckets] == [0, 0, 1, 0, 0, 0]
        assert found.buckets[2].latency_p50_ms == MIN
    finally:
        await table.close()
        await log.close()


@pytest.fixture(scope="module")
def series_database(postgres: Service) -> Iterator[str]:
    with scratch_database(postgres, "assay_series_upgrade") as dsn:
        yield dsn
