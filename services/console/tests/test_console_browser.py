"""The console in a real headless Chromium (Debian's, driven by Playwright): the demo's
data renders, filters and paging keep their state in the URL, the list refreshes
itself, another tenant's run is not reachable by URL, hostile strings show as text;
the ladder's pages draw the sequential test's path and the forest plot with the
seeded numbers; a run's intents and its branch tree are drawn.

One demo, one served data directory and one browser for the whole module.
Screenshots are kept under pytest's temporary directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlparse

import httpx
import pytest
from playwright.sync_api import Browser, FloatRect, Locator, Page, expect, sync_playwright

from assay.cli.demo import DEMO_TENANT
from assay.engine import StubModel
from assay.grading import StubJudge
from assay.grading.sprt import SprtPolicy
from assay.runtime.embedded import STAGES, Embedded
from assay_console.reads import ConsoleReads, SqliteRunsTable
from services.console.tests.branch_seed import seed_branched_run
from services.console.tests.console_seed import HOSTILE, TENANT_A, TENANT_B, run_ref, seed
from services.console.tests.ladder_seed import (
    HELD_OUT_STRENGTH,
    OPEN_PROPOSAL,
    STRENGTH,
    TOURNEY,
    V,
    expected_path,
    seed_ladder,
    seed_open_proposal,
)

ASSAY = str(Path(sys.executable).parent / "assay")
CHROMIUM = os.environ.get("ASSAY_CHROMIUM", "/usr/bin/chromium")
TOKENS = f"{DEMO_TENANT}=token-demo,{TENANT_A}=token-a,{TENANT_B}=token-b"


BRANCHED = f"branched-{HOSTILE}"
"""Tenant A's run with an intent and a branch tree (its task's idempotency key)."""


async def seed_branched(data: Path) -> None:
    """Run the whole pipeline over the data directory once more, for a run with an
    intent that is then branched (before the console-only seeds: no stage but the
    console's may see those)."""
    stages = (*STAGES, "console")
    async with Embedded(
        data, stages=stages, partitions=4, model=StubModel(), judge=StubJudge()
    ) as rt:
        rt.start()
        reads = ConsoleReads(rt.logs["console"], SqliteRunsTable(data / "console.sqlite"))
        try:
            await seed_branched_run(rt, reads, TENANT_A, BRANCHED, HOSTILE)
        finally:
            await reads.close()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A demo's data directory plus seeded hostile runs of two tenants."""
    data = tmp_path_factory.mktemp("demo")
    env = {**os.environ, "ASSAY_DATA_DIR": str(data)}
    demo = subprocess.run(
        [ASSAY, "demo", "--limit", "8", "--no-progress", "--console-port", "0"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # The demo served the console while it ran, and said where.
    assert "console on http://127.0.0.1:" in demo.stdout
    # Playwright's sync API may already run a loop on this thread: seed on another.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, seed_branched(data)).result()
        pool.submit(asyncio.run, seed(data, {DEMO_TENANT: 3, TENANT_B: 2})).result()
        pool.submit(asyncio.run, seed_ladder(data)).result()
        pool.submit(asyncio.run, seed_open_proposal(data)).result()
    return data


@pytest.fixture(scope="module")
def served(data_dir: Path) -> Iterator[str]:
    """The data directory served by `assay console` (which keeps folding)."""
    env = {**os.environ, "ASSAY_DATA_DIR": str(data_dir)}
    env |= {"ASSAY_CONSOLE_TOKENS": TOKENS, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [ASSAY, "console", "--port", "0"], env=env, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until the console says where it is
    assert line.startswith("console on "), line
    try:
        yield line.split()[2]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"no chromium at {CHROMIUM}: `make chromium` installs Debian's")
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("screenshots")


def _tab(browser: Browser, token: str) -> Iterator[Page]:
    context = browser.new_context(extra_http_headers={"authorization": f"Bearer {token}"})
    tab = context.new_page()
    tab.on("dialog", lambda d: pytest.fail(f"a script ran: dialog {d.message!r}"))
    yield tab
    context.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    yield from _tab(browser, "token-demo")


@pytest.fixture
def page_a(browser: Browser) -> Iterator[Page]:
    """A tab of the tenant whose ladder was seeded."""
    yield from _tab(browser, "token-a")


def test_the_demo_renders_on_the_overview(page: Page, served: str, shots: Path) -> None:
    page.goto(f"{served}?tenant={DEMO_TENANT}")
    page.screenshot(path=shots / "overview.png", full_page=True)
    assert int(page.locator("#runs-count").inner_text()) >= 8
    page.get_by_role("link", name="runs").first.click()
    page.wait_for_url("**/runs?**")
    assert page.locator("tr.run").count() >= 8


def test_the_overview_draws_the_stages_and_refreshes_them(
    page: Page, served: str, shots: Path
) -> None:
    """`assay console` runs the console stage in its process: the Stages table shows it
    running, its lag drawn as a bar, and polls `/stages` while the page is visible."""
    page.goto(f"{served}?tenant={DEMO_TENANT}")
    table = page.locator("#stages table.stages")
    expect(table).to_have_attribute("data-mode", "embedded")
    row = page.locator('#stages tr.stage[data-stage="console"]')
    expect(row).to_have_attribute("data-health", "running")
    expect(row).to_have_attribute("data-lag", re.compile(r"^[0-9]+$"))
    assert row.locator("td").nth(1).inner_text().startswith("running")
    assert box(row.locator("svg.lag-bar rect").first)["width"] > 100  # the bar's track
    # Waits for the poll to land (a locator assertion: the page's CSP forbids eval).
    expect(page.locator("#stages")).to_have_attribute("data-refreshed", re.compile(r"^[1-9]"))
    expect(page.locator('#stages tr.stage[data-stage="console"]')).to_have_count(1)
    page.locator("#stages").screenshot(path=shots / "stages.png")


def test_a_filter_lives_in_the_url_and_survives_back(page: Page, served: str) -> None:
    page.goto(f"{served}runs?tenant={DEMO_TENANT}")
    page.select_option("select[name=passed]", "false")
    page.click("#filters button[type=submit]")
    page.wait_for_url("**passed=false**")
    outcomes = page.locator("tr.run td.outcome").all_inner_texts()
    assert outcomes
    assert set(outcomes) == {"failed"}
    page.go_back()
    page.wait_for_url(lambda url: "passed=false" not in url)
    assert "passed" in page.locator("tr.run td.outcome").all_inner_texts()


def test_pages_walk_the_list_by_keyset(page: Page, served: str, shots: Path) -> None:
    page.goto(f"{served}runs?tenant={DEMO_TENANT}&limit=5")
    first = page.locator("tr.run").evaluate_all("rows => rows.map(r => r.dataset.run)")
    page.click("#next")
    page.wait_for_url("**cursor=**")
    page.screenshot(path=shots / "runs-page-2.png", full_page=True)
    second = page.locator("tr.run").evaluate_all("rows => rows.map(r => r.dataset.run)")
    assert len(first) == 5
    assert second
    assert not set(first) & set(second)
    assert max(second) < min(first)  # newest first: the next page is older
    query = parse_qs(urlparse(page.url).query)
    assert query["limit"] == ["5"]


def test_a_run_page_shows_its_timeline_and_verdict(page: Page, served: str, shots: Path) -> None:
    page.goto(f"{served}runs?tenant={DEMO_TENANT}&state=graded")
    page.locator("tr.run a").first.click()
    page.wait_for_url("**/runs/*")
    page.screenshot(path=shots / "run.png", full_page=True)
    assert page.locator("#timeline li").count() >= 3
    assert page.locator("#verdict tr").count() >= 2
    assert page.locator("#state").inner_text() == "graded"
    # The attempts, from execute's log of the demo's run, drawn as a timeline.
    bars = page.locator("#attempts g.attempt")
    assert bars.count() >= 1
    assert bars.first.get_attribute("data-state") == "succeeded"
    assert box(bars.first.locator("rect"))["width"] >= 2
    page.click("#workflow-link")  # from a run to its workflow's ladder
    page.wait_for_url("**/workflows/arith?**")
    assert page.locator("#dag g.node").count() >= 2


def test_a_runs_intents_and_branch_tree_are_drawn(page_a: Page, served: str, shots: Path) -> None:
    listed = httpx.get(
        f"{served}api/runs", params={"key": BRANCHED}, headers={"authorization": "Bearer token-a"}
    )
    (run,) = [r["run_id"] for r in listed.json()["runs"]]
    page_a.goto(f"{served}runs/{run}")
    page_a.screenshot(path=shots / "run-intents.png", full_page=True)
    (intent,) = page_a.locator("#intents tr.intent").all()
    states = intent.locator("li.intent-state strong").all_inner_texts()
    assert states == ["pending", "dispatched", "committed"]
    assert intent.locator("li.intent-state time").count() == 3
    page_a.click("#tree-link")
    page_a.wait_for_url(f"**/runs/{run}/tree?**")
    page_a.screenshot(path=shots / "branch-tree.png", full_page=True)
    assert page_a.locator("#branch-tree li.branch").count() == 3
    forked = page_a.locator("#branch-0 > ul > li.branch")
    assert [b.get_attribute("data-branch") for b in forked.all()] == ["1", "2"]
    assert "forked from branch 0 at LSN" in forked.first.inner_text()
    children = page_a.locator("table.children tr.child")
    assert children.locator("td.label").all_inner_texts() == [
        f"no-strip {HOSTILE}",
        f"short {HOSTILE}",
    ]
    assert children.first.locator("td.deltas").inner_text() == "tool_unavailable:strip"
    assert children.first.locator("td.divergence").inner_text().startswith("tidy:")
    assert page_a.locator("#key").inner_text().startswith(BRANCHED)
    assert page_a.evaluate("window.__pwned") is None
    assert page_a.locator("img[src=x]").count() == 0


def test_another_tenants_run_is_not_reachable_by_url(page: Page, served: str) -> None:
    theirs = run_ref(TENANT_B, 0).run_id
    response = page.goto(f"{served}runs/{theirs}?tenant={DEMO_TENANT}")
    assert response is not None
    assert response.status == 404
    assert page.locator("#problem").inner_text() == "no such run"
    response = page.goto(f"{served}runs/{theirs}?tenant={TENANT_B}")
    assert response is not None
    assert response.status == 404


def test_hostile_strings_show_as_text(page: Page, served: str, shots: Path) -> None:
    page.goto(f"{served}runs?tenant={DEMO_TENANT}&key=%3Cscript%3E")
    assert page.locator("tr.run td.key").first.inner_text() == f"{HOSTILE}-0"
    page.locator("tr.run a").first.click()
    page.wait_for_url("**/runs/*")
    page.screenshot(path=shots / "hostile-run.png", full_page=True)
    assert page.locator("#output").inner_text() == HOSTILE
    assert HOSTILE in page.locator("#input").inner_text()
    assert HOSTILE in page.locator("#verdict").inner_text()
    assert page.evaluate("window.__pwned") is None
    assert page.locator("img[src=x]").count() == 0


def test_the_first_page_refreshes_itself_while_visible(page: Page, served: str) -> None:
    page.goto(f"{served}runs?tenant={DEMO_TENANT}")
    # Waits for the poll to land (a locator assertion: the page's CSP forbids eval).
    expect(page.locator("#runs")).to_have_attribute("data-refreshed", re.compile(r"^[1-9]"))
    assert page.locator("#updated").inner_text().endswith("UTC")
    assert page.locator("tr.run").count() >= 8


def test_the_cli_lists_what_the_api_lists(served: str, data_dir: Path) -> None:
    argv = [ASSAY, "--data-dir", str(data_dir), "runs", "list", "--tenant", str(DEMO_TENANT)]
    token = {"authorization": "Bearer token-demo"}

    def api(**params: str) -> dict[str, Any]:
        got = httpx.get(f"{served}api/runs", params=params, headers=token, timeout=30)
        return dict(got.json())

    listed = subprocess.run(
        [*argv, "--limit", "5", "--passed", "true", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert json.loads(listed.stdout) == api(limit="5", passed="true")
    table = subprocess.run(
        [*argv, "--limit", "5"], capture_output=True, text=True, check=True, timeout=120
    )
    lines = table.stdout.splitlines()
    assert lines[0].split()[0] == "run_id"
    assert [line.split()[0] for line in lines[1:6]] == [r["run_id"] for r in api(limit="5")["runs"]]


def box(locator: Locator) -> FloatRect:
    """Where the browser drew an element."""
    found = locator.bounding_box()
    assert found is not None, locator
    return found


def middle(locator: Locator) -> float:
    """The vertical middle of a drawn element."""
    drawn = box(locator)
    return drawn["y"] + drawn["height"] / 2


def test_the_demos_workflow_shows_its_ladder(page: Page, served: str, shots: Path) -> None:
    page.goto(f"{served}workflows?tenant={DEMO_TENANT}")
    page.get_by_role("link", name="arith").click()
    page.wait_for_url("**/workflows/arith?**")
    page.screenshot(path=shots / "demo-workflow.png", full_page=True)
    assert page.locator("#dag g.node").count() >= 2  # v1 and the challenger the demo registered
    assert page.locator("#dag g.node[data-status=current]").count() == 1
    assert page.locator("#rungs tr.rung").count() >= 2


def test_the_sequential_tests_path_is_drawn(page_a: Page, served: str, shots: Path) -> None:
    page_a.goto(f"{served}workflows/arith")
    page_a.screenshot(path=shots / "ladder.png", full_page=True)
    chart = page_a.locator(f"section[data-version='{V['v2']}'] svg.sprt")
    policy = SprtPolicy()
    assert float(chart.get_attribute("data-upper") or "nan") == pytest.approx(policy.upper)
    assert float(chart.get_attribute("data-lower") or "nan") == pytest.approx(policy.lower)
    steps = chart.locator("circle.step")
    drawn = steps.evaluate_all(
        "cs => cs.map(c => [Number(c.dataset.comparisons), Number(c.dataset.llr),"
        " c.getBoundingClientRect().y])"
    )
    expected = expected_path(policy)
    assert [n for n, _, _ in drawn] == [n for n, _ in expected]
    assert [x for _, x, _ in drawn] == pytest.approx([x for _, x in expected])
    upper, lower = middle(chart.locator("line.upper")), middle(chart.locator("line.lower"))
    for (_, ratio), marker in zip(expected, drawn, strict=True):
        assert (marker[2] + 3 < upper) is (ratio >= policy.upper)  # above the accept line
        assert marker[2] + 3 < lower  # never below the reject line
    path = chart.locator("polyline.path").get_attribute("points") or ""
    assert len(path.split()) == len(expected)
    assert chart.locator("circle.crossing").get_attribute("data-comparisons") == "12"
    assert chart.get_attribute("data-decision") == "accept"
    judge = page_a.locator(f"section[data-version='{V['v2']}'] dd.judge").inner_text()
    assert judge == "8 wins, 1 losses, 1 draws"
    verifier = page_a.locator(f"section[data-version='{V['v2']}'] dd.verifier").inner_text()
    assert verifier == "2 wins, 0 losses"
    assert "capped" in page_a.locator("#decisions tr.outcome-rolled_back").inner_text()


def test_the_forest_plot_is_drawn(page_a: Page, served: str, shots: Path) -> None:
    page_a.goto(f"{served}workflows")
    page_a.get_by_role("link", name=TOURNEY).click()
    page_a.wait_for_url("**/workflows/%3Cscript%3E*")
    page_a.screenshot(path=shots / "forest.png", full_page=True)
    assert page_a.locator("#workflow-name").inner_text() == TOURNEY
    assert page_a.evaluate("window.__pwned") is None
    rows = page_a.locator("svg.forest g.strength")
    assert rows.count() == 2
    for i, s in enumerate((STRENGTH, HELD_OUT_STRENGTH)):
        row = rows.nth(i)
        assert float(row.get_attribute("data-mean") or "nan") == pytest.approx(s.mean)
        assert float(row.get_attribute("data-low") or "nan") == pytest.approx(s.interval[0])
        assert float(row.get_attribute("data-high") or "nan") == pytest.approx(s.interval[1])
        line, point = box(row.locator("line")), box(row.locator("circle"))
        centre = point["x"] + point["width"] / 2
        assert line["x"] < centre < line["x"] + line["width"]
    control = box(page_a.locator("svg.forest line.control"))["x"]
    first, second = box(rows.nth(0).locator("line")), box(rows.nth(1).locator("line"))
    assert first["x"] > control  # the selection interval lies wholly above control
    assert second["x"] < control < second["x"] + second["width"]  # held out: a tie


def test_another_tenants_workflow_is_not_reachable_by_url(page: Page, served: str) -> None:
    response = page.goto(f"{served}workflows/{TOURNEY.replace('/', '%2F')}")
    assert response is not None
    assert response.status == 404
    assert page.locator("#problem").inner_text() == "no such workflow"
    response = page.goto(f"{served}workflows/arith?tenant={TENANT_A}")
    assert response is not None
    assert response.status == 404


def test_a_live_challengers_ladder_refreshes_itself(page_a: Page, served: str) -> None:
    page_a.goto(f"{served}workflows/{TOURNEY.replace('/', '%2F')}")
    # Waits for the poll to land (a locator assertion: the page's CSP forbids eval).
    expect(page_a.locator("#ladder")).to_have_attribute("data-refreshed", re.compile(r"^[1-9]"))
    assert page_a.locator("#updated").inner_text().endswith("UTC")
    assert page_a.locator("svg.forest g.strength").count() == 2
    assert page_a.evaluate("window.__pwned") is None
    page_a.goto(f"{served}workflows/arith")  # no live challenger: nothing to refresh
    assert page_a.locator("#ladder").get_attribute("data-poll") is None


def test_rejecting_an_open_proposal_from_its_page_takes_effect(
    browser: Browser, served: str, shots: Path
) -> None:
    b = {"authorization": "Bearer token-b"}
    context = browser.new_context(extra_http_headers=b)
    tab = context.new_page()
    asked: list[str] = []

    def confirm(dialog: Any) -> None:
        asked.append(dialog.message)
        dialog.accept()

    tab.on("dialog", confirm)
    try:
        tab.goto(f"{served}?tenant={TENANT_B}")
        tab.click("a.proposals")
        tab.wait_for_url("**/proposals?**")
        row = tab.locator(f"tr.proposal[data-proposal='{OPEN_PROPOSAL}']")
        expect(row.locator("td.rationale")).to_have_text(HOSTILE)
        row.locator("button[data-verb='reject']").click()
        expect(row.locator(".outcome")).to_contain_text("reject: applied (rejected)")
        tab.screenshot(path=shots / "proposals.png", full_page=True)
        assert asked == ["Reject this proposal? The proposer is asked for the next one."]
        assert tab.evaluate("window.__pwned") is None
    finally:
        context.close()
    with httpx.Client(base_url=served, headers=b) as client:
        seen = client.get(f"/api/proposals/{OPEN_PROPOSAL}").json()
        assert (seen["status"], seen["review"]) == ("rejected", "from the console")
        assert client.get("/api/proposals").json() == {"proposals": []}


def test_a_login_sees_only_its_own_tenant(browser: Browser, served: str, shots: Path) -> None:
    context = browser.new_context()  # no bearer token: the login cookie alone
    tab = context.new_page()
    try:
        tab.goto(f"{served}runs?tenant={TENANT_B}")
        tab.wait_for_url("**/login?next=*")  # not logged in: the login page, coming back
        tab.fill("#token", "token-b")
        tab.click("#login button[type=submit]")
        tab.wait_for_url(f"**/runs?tenant={TENANT_B}")
        assert tab.locator("tr.run").count() == 2
        (session,) = [c for c in context.cookies() if c["name"] == "assay_session"]
        assert session["httpOnly"]
        assert session["sameSite"] == "Strict"
        tab.goto(served)
        tab.screenshot(path=shots / "logged-in-overview.png", full_page=True)
        assert tab.locator("section.tenant").evaluate_all("s => s.map(e => e.dataset.tenant)") == [
            str(TENANT_B)
        ]
        theirs = run_ref(DEMO_TENANT, 0).run_id
        response = tab.goto(f"{served}runs/{theirs}?tenant={TENANT_B}")
        assert response is not None
        assert response.status == 404
        response = tab.goto(f"{served}runs/{theirs}?tenant={DEMO_TENANT}")
        assert response is not None
        assert response.status == 404
        tab.goto(f"{served}runs?tenant={TENANT_B}")
        expect(tab.locator("#logout")).to_be_visible()
        tab.click("#logout button")
        tab.wait_for_url("**/login")
        assert not [c for c in context.cookies() if c["name"] == "assay_session"]
    finally:
        context.close()


def test_the_spend_page_draws(page: Page, served: str, shots: Path) -> None:
    page.goto(f"{served}?tenant={DEMO_TENANT}")
    page.get_by_role("link", name="spend").first.click()
    page.wait_for_url("**/spend?**")
    page.screenshot(path=shots / "spend.png", full_page=True)
    # The demo's runs called the model: work calls drawn, one point per day, above zero.
    work = page.locator("svg.spend-calls g.series[data-name=work] circle")
    assert work.count() == 7
    assert float(work.last.get_attribute("data-value") or 0) >= 8
    assert box(page.locator("svg.spend-calls g.series[data-name=work] polyline"))["width"] > 100
    # Each ceiling in the table with today's use; the grading one drawn on the chart.
    assert page.locator("#ceilings tr.ceiling").count() == 5  # replay's: calls, tokens, $
    grading = page.locator("#ceilings tr.ceiling[data-purpose=grading]")
    assert float(grading.get_attribute("data-limit") or 0) > 0
    expect(page.locator("svg.spend-calls g.limit[data-name=grading]")).to_have_count(1)
    response = page.goto(f"{served}spend?tenant={TENANT_B}")
    assert response is not None
    assert response.status == 404


def _values(page: Page, chart: str, name: str) -> list[float]:
    dots = page.locator(f"svg.{chart} g.series[data-name='{name}'] circle")
    return [float(d.get_attribute("data-value") or "nan") for d in dots.all()]


def test_the_overview_draws_the_tenant_over_time(page: Page, served: str, shots: Path) -> None:
    end = datetime.now(UTC).isoformat()
    page.goto(f"{served}?tenant={DEMO_TENANT}&window=1h&end={quote(end)}")
    page.screenshot(path=shots / "overview-series.png", full_page=True)
    api = httpx.get(
        f"{served}api/overview/series",
        params={"tenant": str(DEMO_TENANT), "window": "1h", "end": end},
        headers={"authorization": "Bearer token-demo"},
    ).json()["buckets"]
    assert len(api) == 60
    # The demo's eight runs came in and went out within the hour; the seeded three (made
    # long ago) went out in it. Each chart's points are the API's buckets.
    assert sum(b["tasks_in"] for b in api) >= 8
    assert sum(b["results_out"] for b in api) >= 11
    assert _values(page, "overview-volume", "tasks in") == [b["tasks_in"] for b in api]
    assert _values(page, "overview-volume", "results out") == [b["results_out"] for b in api]
    # A dot's data-value is printed to six significant digits (`%g`): the seeded runs'
    # latency, months long, does not fit in six digits of seconds.
    rates = [b["pass_rate"] for b in api if b["pass_rate"] is not None]
    assert _values(page, "overview-pass-rate", "pass rate") == pytest.approx(rates, rel=1e-5)
    p95 = [b["latency_p95_ms"] / 1000 for b in api if b["latency_p95_ms"] is not None]
    assert _values(page, "overview-latency", "p95 s") == pytest.approx(p95, rel=1e-5)
    assert (
        box(page.locator("svg.overview-volume g.series[data-name='results out'] polyline"))["width"]
        > 0
    )
    expect(page.locator("svg.overview-throughput g.series circle")).to_have_count(60)
    # Pinned to `end`, the charts stay; up to now, they refresh themselves.
    expect(page.locator(".overview-series[data-poll]")).to_have_count(0)
    page.goto(f"{served}?tenant={DEMO_TENANT}")
    series = page.locator(f".overview-series[data-tenant='{DEMO_TENANT}']")
    # every 15 s (each refresh reads the whole window)
    expect(series).to_have_attribute("data-refreshed", re.compile(r"^[1-9]"), timeout=25_000)
    expect(series.locator("svg.overview-volume g.series circle")).to_have_count(48)
