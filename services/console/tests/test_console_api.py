"""The console's JSON API and pages over a seeded store: scoping by token, keyset pages,
filters, bad input, escaping, and the committed OpenAPI document."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime

import httpx
import pytest
import pytest_asyncio

from assay.kernel.ids import TenantId
from assay.store.sqlite import SqliteEventLog
from assay_console.access import Access
from assay_console.app import create_app
from assay_console.reads import ConsoleReads, SqliteRunsTable
from assay_console.stage import CONSOLE_EVENTS, RUNS_TABLE, fold_console
from services.console.tests.console_seed import HOSTILE, T0_MS, TENANT_A, TENANT_B, run_ref, seed

TOKENS = f"{TENANT_A}=token-a,{TENANT_B}=token-b"
A = {"authorization": "Bearer token-a"}
B = {"authorization": "Bearer token-b"}
ADMIN = {"authorization": "Bearer token-admin"}
COUNT_A, COUNT_B = 7, 2
pytestmark = pytest.mark.asyncio(loop_scope="module")


def at(n: int) -> str:
    """When seeded run `n` was created (ISO 8601)."""
    return datetime.fromtimestamp((T0_MS + n * 1000) / 1000, UTC).isoformat()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[httpx.AsyncClient]:
    data = tmp_path_factory.mktemp("console")
    await seed(data, {TENANT_A: COUNT_A, TENANT_B: COUNT_B})
    store = data / "console.sqlite"
    log = await SqliteEventLog(store, CONSOLE_EVENTS, fold_console, tables=(RUNS_TABLE,)).open()
    reads = ConsoleReads(log, SqliteRunsTable(store))
    app = create_app(reads, Access.parse(TOKENS, "token-admin", "127.0.0.1"))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://console") as c:
        yield c
    await reads.close()
    await log.close()


def rid(tenant: TenantId, n: int) -> str:
    return str(run_ref(tenant, n).run_id)


async def test_runs_are_the_tokens_tenants_newest_first(client: httpx.AsyncClient) -> None:
    page = (await client.get("/api/runs", headers=A)).json()
    assert [r["run_id"] for r in page["runs"]] == [rid(TENANT_A, n) for n in reversed(range(7))]
    assert page["next_cursor"] is None
    b = (await client.get("/api/runs", headers=B)).json()
    assert {r["run_id"] for r in b["runs"]} == {rid(TENANT_B, 0), rid(TENANT_B, 1)}


async def test_keyset_pages_walk_every_run_once(client: httpx.AsyncClient) -> None:
    seen: list[str] = []
    cursor = None
    while True:
        params = {"limit": "3", **({"cursor": cursor} if cursor else {})}
        page = (await client.get("/api/runs", headers=A, params=params)).json()
        assert len(page["runs"]) <= 3
        seen += [r["run_id"] for r in page["runs"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [rid(TENANT_A, n) for n in reversed(range(7))]


async def test_limit_is_capped_on_the_server(client: httpx.AsyncClient) -> None:
    page = (await client.get("/api/runs", headers=A, params={"limit": "100000"})).json()
    assert len(page["runs"]) == COUNT_A


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"workflow": "other"}, [5, 2]),
        ({"workflow": "arith", "passed": "true"}, [6, 4, 0]),
        ({"passed": "false"}, [5, 3, 1]),
        ({"state": "ungraded"}, [6, 5, 4, 3, 2, 1, 0]),
        ({"state": "running"}, []),
        ({"key": "task-00"}, [6, 5, 4, 3, 2, 1]),
        ({"key": "<script>"}, [0]),
        ({"since": at(4)}, [6, 5, 4]),
        ({"until": at(4)}, [3, 2, 1, 0]),
        ({"since": at(2), "until": at(4), "passed": "false"}, [3]),
    ],
)
async def test_filters_combine(
    client: httpx.AsyncClient, params: dict[str, str], expected: list[int]
) -> None:
    page = (await client.get("/api/runs", headers=A, params=params)).json()
    assert [r["run_id"] for r in page["runs"]] == [rid(TENANT_A, n) for n in expected]


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"colour": "red"}, "unknown filter: colour"),
        ({"cursor": "!!!"}, "cursor is malformed"),
        ({"limit": "ten"}, "limit"),
        ({"state": "exploded"}, "state"),
        ({"passed": "maybe"}, "passed"),
        ({"since": "yesterday"}, "since"),
        ({"version": "v1"}, "version filters need a workflow"),
    ],
)
async def test_bad_input_names_the_problem(
    client: httpx.AsyncClient, params: dict[str, str], named: str
) -> None:
    response = await client.get("/api/runs", headers=A, params=params)
    assert response.status_code == 400
    assert named in response.json()["detail"]


async def test_a_cursor_belongs_to_its_filters(client: httpx.AsyncClient) -> None:
    page = (await client.get("/api/runs", headers=A, params={"limit": "2"})).json()
    other = {"limit": "2", "passed": "true", "cursor": page["next_cursor"]}
    response = await client.get("/api/runs", headers=A, params=other)
    assert response.status_code == 400
    assert "other filters" in response.json()["detail"]


async def test_a_run_has_its_timeline_verdict_score_and_usage(client: httpx.AsyncClient) -> None:
    run = (await client.get(f"/api/runs/{rid(TENANT_A, 1)}", headers=A)).json()
    assert [t["state"] for t in run["timeline"]] == [
        "running",
        "verifying",
        "verified_fail",
        "ungraded",
    ]
    assert run["run"]["passed"] is False
    assert run["verdict"][0]["passed"] is False
    assert run["score"] == {"kind": "ungraded", "reason": "no_reference"}
    assert run["usage"] == {"model_calls": 1, "prompt_tokens": 3, "completion_tokens": 7}
    assert run["input"] == {"question": "1 + 1"}


async def test_another_tenants_run_is_a_404_like_a_missing_one(
    client: httpx.AsyncClient,
) -> None:
    theirs = await client.get(f"/api/runs/{rid(TENANT_B, 0)}", headers=A)
    missing = await client.get(f"/api/runs/{rid(TENANT_A, 99)}", headers=A)
    assert theirs.status_code == missing.status_code == 404
    assert theirs.json() == missing.json()
    page = await client.get(f"/runs/{rid(TENANT_B, 0)}", headers=A)
    assert page.status_code == 404
    assert "1 + 1" not in page.text
    assert "task-001" not in page.text


async def test_another_tenants_list_is_not_reachable(client: httpx.AsyncClient) -> None:
    response = await client.get("/api/runs", headers=A, params={"tenant": str(TENANT_B)})
    assert response.status_code == 404
    pages = await client.get("/runs", headers=A, params={"tenant": str(TENANT_B)})
    assert pages.status_code == 404


async def test_another_tenants_overview_is_not_reachable(client: httpx.AsyncClient) -> None:
    response = await client.get("/api/overview", headers=B, params={"tenant": str(TENANT_A)})
    assert response.status_code == 404


async def test_the_overview_counts_states_results_and_reasons(
    client: httpx.AsyncClient,
) -> None:
    view = (await client.get("/api/overview", headers=A)).json()
    assert view["runs"] == view["results"] == COUNT_A
    assert view["by_state"] == {"ungraded": COUNT_A}
    assert view["pass_rate"] == pytest.approx(4 / 7)
    assert view["graded"] == 0
    assert view["ungraded"] == {"no_reference": COUNT_A}
    assert view["indeterminate"] == 0


async def test_the_admin_names_the_tenant(client: httpx.AsyncClient) -> None:
    unnamed = await client.get("/api/overview", headers=ADMIN)
    assert unnamed.status_code == 400
    assert "tenant" in unnamed.json()["detail"]
    named = await client.get("/api/overview", headers=ADMIN, params={"tenant": str(TENANT_B)})
    assert named.json()["runs"] == COUNT_B


async def test_without_a_known_token_nothing_is_answered(client: httpx.AsyncClient) -> None:
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "token-a"}):
        response = await client.get("/api/runs", headers=headers)
        assert response.status_code == 401


async def test_a_malformed_run_id_is_a_400(client: httpx.AsyncClient) -> None:
    response = await client.get("/api/runs/not-a-run", headers=A)
    assert response.status_code == 400
    assert "not a ULID" in response.json()["detail"]


async def test_hostile_strings_are_escaped_on_every_page(client: httpx.AsyncClient) -> None:
    run = rid(TENANT_A, 0)
    for path in ("/runs", f"/runs/{run}", "/runs?key=%3Cscript%3E"):
        page = await client.get(path, headers=A)
        assert page.status_code == 200
        assert "<script>window" not in page.text
        assert "<img src=x" not in page.text
        assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in page.text
    detail = (await client.get(f"/api/runs/{run}", headers=A)).json()
    assert detail["output"] == HOSTILE  # the API gives the data as it is; pages escape it
    csp = (await client.get("/runs", headers=A)).headers["content-security-policy"]
    assert "default-src 'self'" in csp
