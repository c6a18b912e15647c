"""Stage health and lag (`stages.py`, `GET /api/stages`, the overview's Stages section):
the figures parsed from the Prometheus text the project's own registries produce, read
over HTTP from real status servers (ready, not ready, gone, paused), and served by the
console's API and pages in embedded mode."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from prometheus_client import generate_latest

from assay.devstack import free_port
from assay.runtime.embedded import Embedded
from assay.runtime.http import StatusServer
from assay.runtime.signals import Signals
from assay.store.sqlite import SqliteEventLog
from assay_console.access import Access
from assay_console.app import create_app
from assay_console.reads import ConsoleReads, SqliteRunsTable
from assay_console.stages import Health, HttpStages, ProcessStages, parse
from services.console.tests.console_seed import TENANT_A, TENANT_B, messages, until_folded

TOKENS = f"{TENANT_A}=token-a,{TENANT_B}=token-b"
A = {"authorization": "Bearer token-a"}
ADMIN = {"authorization": "Bearer token-admin"}
COUNT = 5
pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_quantiles_come_from_the_handler_histograms_buckets() -> None:
    signals = Signals()
    for _ in range(50):
        signals.handled("verify", "RunExecuted", 0.003)
        signals.handled("verify", "RunExecuted", 0.3)
    signals.handled("ingest", "TaskSubmitted", 0.02)
    found = parse(generate_latest(signals.registry).decode())
    verify = found["verify"]
    p50, p95 = verify.quantile(0.5), verify.quantile(0.95)
    assert p50 is not None
    assert 0.0025 < p50 <= 0.005
    assert p95 is not None
    assert 0.25 < p95 <= 0.5
    ingest = found["ingest"].quantile(0.5)
    assert ingest is not None
    assert 0.01 < ingest <= 0.025
    assert parse("") == {}


async def test_a_quantile_past_the_last_bucket_is_the_last_bound() -> None:
    signals = Signals()
    signals.handled("execute", "RunSpawned", 120.0)
    found = parse(generate_latest(signals.registry).decode())["execute"]
    assert found.quantile(0.5) == 30.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rt(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Embedded]:
    """The console stage with `COUNT` runs of each tenant on its topics, not yet read."""
    data = tmp_path_factory.mktemp("stages")
    async with Embedded(data, stages=("console",), partitions=4) as running:
        items = [
            (topic, msg, tenant, f"{tenant}:{idem}")
            for tenant in (TENANT_A, TENANT_B)
            for topic, msg, idem in messages(tenant, COUNT)
        ]
        await running.publish_many(items)
        yield running


async def test_embedded_lag_is_every_record_until_the_stage_reads_them(rt: Embedded) -> None:
    """Parsed from the process registry's own text: before the stage runs, its lag is
    every record on its topics, per partition; once it has read them, none, and its
    handling times show."""
    registry, refresh = rt.metrics()
    on_topics = 0
    for topic in rt.runners["console"].spec.topics:
        on_topics += sum((await rt.bus.end_offsets(topic)).values())
    assert on_topics > 0
    await refresh()
    before = parse(generate_latest(registry).decode())["console"]
    assert sum(before.lag.values()) == on_topics
    assert {t for t, _ in before.lag} == set(rt.runners["console"].spec.topics)
    assert before.handled == 0
    assert before.quantile(0.5) is None
    view = await ProcessStages.of(rt).read()
    (stage,) = view.stages
    assert (view.mode, stage.name, stage.health) == ("embedded", "console", Health.NOT_READY)
    assert stage.lag_total == on_topics

    rt.start()
    await until_folded(rt)
    await refresh()
    after = parse(generate_latest(registry).decode())["console"]
    assert sum(after.lag.values()) == 0
    assert after.handled == on_topics
    (stage,) = (await ProcessStages.of(rt).read()).stages
    assert stage.health is Health.RUNNING
    assert stage.lag_total == 0
    assert stage.handled == on_topics
    assert stage.p50_s is not None
    assert stage.p95_s is not None
    assert stage.p50_s <= stage.p95_s


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(rt: Embedded) -> AsyncIterator[httpx.AsyncClient]:
    store = rt.data_dir / "console.sqlite"
    reads = ConsoleReads(rt.logs["console"], SqliteRunsTable(store))
    access = Access.parse(TOKENS, "token-admin", "127.0.0.1")
    app = create_app(reads, access, stages=ProcessStages.of(rt))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://console") as c:
        yield c
    await reads.close()


async def test_the_api_shows_every_caller_the_stages(client: httpx.AsyncClient) -> None:
    for who in (A, ADMIN):
        answer = await client.get("/api/stages", headers=who)
        assert answer.status_code == 200, answer.text
        doc = answer.json()
        assert doc["mode"] == "embedded"
        assert [s["name"] for s in doc["stages"]] == ["console"]
        assert doc["stages"][0]["health"] in ("running", "not_ready")
        assert isinstance(doc["stages"][0]["lag_total"], int)
    assert (await client.get("/api/stages")).status_code == 401
    odd = await client.get("/api/stages", headers=A, params={"tenant": str(TENANT_B)})
    assert (odd.status_code, odd.json()["detail"]) == (400, "unknown parameter: tenant")


async def test_the_overview_draws_the_stages_and_polls_them(client: httpx.AsyncClient) -> None:
    page = (await client.get("/", headers=A)).text
    assert '<section id="stages" data-poll="/stages">' in page
    assert 'data-stage="console"' in page
    assert 'class="lag-bar"' in page
    fragment = await client.get("/stages", headers={**A, "x-console-poll": "1"})
    assert fragment.status_code == 200
    assert "<html" not in fragment.text
    assert 'data-stage="console"' in fragment.text
    whole = (await client.get("/stages", headers=A)).text
    assert "<html" in whole
    assert 'data-stage="console"' in whole
    away = await client.get("/stages")
    assert away.status_code == 303
    assert away.headers["location"].startswith("/login")


async def test_stages_are_read_over_http_ready_not_ready_gone_or_paused(rt: Embedded) -> None:
    """Real status servers: a ready one (with the process's metrics), one that is not
    ready (its reasons shown), a ready one whose /metrics fails, a port nobody listens
    on, and one that accepts and never answers (a paused process): none of the last
    three stops the others' figures."""
    registry, refresh = rt.metrics()
    ready = StatusServer(registry, lambda: {"ok": True}, 0, refresh)
    reasons = ["consumer has not joined its group"]
    unready = StatusServer(
        registry,
        lambda: {"ok": True},
        0,
        refresh,
        readiness=lambda: {"ready": False, "reasons": reasons},
    )

    async def broken() -> None:
        raise RuntimeError("the store did not answer")

    blind = StatusServer(registry, lambda: {"ok": True}, 0, broken)  # /metrics fails
    paused = socket.socket()
    paused.bind(("127.0.0.1", 0))
    paused.listen(8)  # accepts into the backlog, answers nothing: a SIGSTOPped stage
    try:
        urls = {
            "console": f"http://127.0.0.1:{await ready.start('127.0.0.1')}",
            "unready": f"http://127.0.0.1:{await unready.start('127.0.0.1')}",
            "blind": f"http://127.0.0.1:{await blind.start('127.0.0.1')}",
            "gone": f"http://127.0.0.1:{free_port()}",
            "paused": f"http://127.0.0.1:{paused.getsockname()[1]}",
        }
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        view = await HttpStages(urls, timeout_s=1.0).read()
        assert loop.time() - t0 < 3.0, "the stages are read concurrently, each within its timeout"
    finally:
        await ready.close()
        await unready.close()
        await blind.close()
        paused.close()
    by = {s.name: s for s in view.stages}
    assert [s.name for s in view.stages] == list(urls)
    assert view.mode == "distributed"
    assert by["console"].health is Health.READY
    assert by["console"].reasons == []
    (here,) = (await ProcessStages.of(rt).read()).stages
    assert (by["console"].lag_total, by["console"].handled) == (here.lag_total, here.handled)
    assert by["console"].p95_s == here.p95_s
    assert by["unready"].health is Health.NOT_READY
    assert by["unready"].reasons == reasons
    assert by["unready"].lag_total is not None
    assert by["blind"].health is Health.READY
    assert by["blind"].lag_total is None
    assert by["blind"].reasons[0].startswith(f"{urls['blind']}/metrics: ")
    for name in ("gone", "paused"):
        assert by[name].health is Health.UNREACHABLE, by[name]
        assert by[name].lag_total is None
        assert by[name].reasons
        assert urls[name] in by[name].reasons[0]
    assert "Timeout" in by["paused"].reasons[0]
    assert "Connect" in by["gone"].reasons[0]


async def test_a_console_without_stage_urls_says_so(tmp_path: Path) -> None:
    store = tmp_path / "console.sqlite"
    from assay_console.stage import CONSOLE_EVENTS, RUNS_TABLE, fold_console

    log = await SqliteEventLog(store, CONSOLE_EVENTS, fold_console, tables=(RUNS_TABLE,)).open()
    reads = ConsoleReads(log, SqliteRunsTable(store))
    app = create_app(reads, Access.parse(TOKENS, "token-admin", "127.0.0.1"))
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://c") as c:
            assert (await c.get("/api/stages", headers=A)).json() == {"mode": "none", "stages": []}
            assert "ASSAY_CONSOLE_STAGE_URLS" in (await c.get("/", headers=A)).text
    finally:
        await reads.close()
        await log.close()
