"""The console's workflows and ladder over a seeded store: the version DAG, the
allocation's rungs, the sequential test's path with its boundaries, the win record
(judge and verifier apart), pass rates and the held-out gap, strengths against control,
rollbacks, rejections and proposals — tenant-scoped, with hostile names escaped."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from urllib.parse import quote, urlencode

import httpx
import pytest
import pytest_asyncio

from assay.grading.sprt import SprtPolicy, llr
from assay.kernel.scores import WinRecord
from assay.store.sqlite import SqliteEventLog
from assay_console.access import Access
from assay_console.app import create_app
from assay_console.charts import sprt_chart
from assay_console.ladder import EvidenceSeen
from assay_console.reads import ConsoleReads, SqliteRunsTable
from assay_console.stage import CONSOLE_EVENTS, RUNS_TABLE, fold_console
from assay_console.workflows import sprt_path
from services.console.tests.console_seed import HOSTILE, TENANT_A, TENANT_B
from services.console.tests.ladder_seed import (
    HELD_OUT_STRENGTH,
    PROPOSAL,
    REJECT_REASON,
    ROLLBACK_REASON,
    STRENGTH,
    TOURNEY,
    V,
    expected_path,
    seed_ladder,
)

A = {"authorization": "Bearer token-a"}
B = {"authorization": "Bearer token-b"}
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[httpx.AsyncClient]:
    data = tmp_path_factory.mktemp("ladder")
    await seed_ladder(data)
    store = data / "console.sqlite"
    log = await SqliteEventLog(store, CONSOLE_EVENTS, fold_console, tables=(RUNS_TABLE,)).open()
    reads = ConsoleReads(log, SqliteRunsTable(store))
    tokens = f"{TENANT_A}=token-a,{TENANT_B}=token-b"
    app = create_app(reads, Access.parse(tokens, None, "127.0.0.1"))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://console") as c:
        yield c
    await reads.close()
    await log.close()


def url(workflow: str, api: bool = True) -> str:
    return f"{'/api' if api else ''}/workflows/{quote(workflow, safe='')}"


async def test_the_list_holds_the_tenants_workflows(client: httpx.AsyncClient) -> None:
    listed = (await client.get("/api/workflows", headers=A)).json()["workflows"]
    assert [w["workflow_id"] for w in listed] == sorted(["arith", TOURNEY])
    arith = next(w for w in listed if w["workflow_id"] == "arith")
    assert arith["current"] == V["v2"]
    assert arith["challenger"] is None
    assert arith["generation"] == 6
    tourney = next(w for w in listed if w["workflow_id"] == TOURNEY)
    assert (tourney["challenger"], tourney["rung"]) == (V["t2"], "shadow")
    theirs = (await client.get("/api/workflows", headers=B)).json()["workflows"]
    assert [w["workflow_id"] for w in theirs] == ["secret"]


async def test_the_dag_has_parents_proposals_and_statuses(client: httpx.AsyncClient) -> None:
    d = (await client.get(url("arith"), headers=A)).json()
    nodes = {n["version"]: n for n in d["versions"]}
    assert list(nodes) == [V["v1"], V["v2"], V["v3"], V["p1"]]
    assert nodes[V["v1"]]["parents"] == []
    assert nodes[V["v2"]]["parents"] == [V["v1"]]
    assert nodes[V["v3"]]["parents"] == [V["v2"]]
    assert nodes[V["p1"]]["parents"] == [V["v2"]]
    assert nodes[V["p1"]]["proposal"] == PROPOSAL
    statuses = [nodes[V[n]]["status"] for n in ("v1", "v2", "v3", "p1")]
    assert statuses == ["retired", "current", "rolled_back", "proposal_rejected"]


async def test_rungs_climbed_with_timestamps(client: httpx.AsyncClient) -> None:
    d = (await client.get(url("arith"), headers=A)).json()
    climbed = [(r["generation"], r["challenger"], r["rung"], r["share"]) for r in d["rungs"]]
    assert climbed == [
        (1, None, None, 0.0),
        (2, V["v2"], "shadow", 0.0),
        (3, V["v2"], "trial", 0.05),
        (4, None, None, 0.0),
        (5, V["v3"], "shadow", 0.0),
        (6, None, None, 0.0),
    ]
    times = [r["at"] for r in d["rungs"]]
    assert times == sorted(times)
    assert len(set(times)) == len(times)


async def test_the_sequential_tests_path_between_its_boundaries(
    client: httpx.AsyncClient,
) -> None:
    d = (await client.get(url("arith"), headers=A)).json()
    v2 = next(c for c in d["challengers"] if c["version"] == V["v2"])
    policy = SprtPolicy()
    expected = expected_path(policy)
    assert [p["comparisons"] for p in v2["sprt"]["points"]] == [n for n, _ in expected]
    assert [p["llr"] for p in v2["sprt"]["points"]] == pytest.approx([x for _, x in expected])
    assert v2["sprt"]["upper"] == pytest.approx(policy.upper)
    assert v2["sprt"]["lower"] == pytest.approx(policy.lower)
    assert v2["sprt"]["decision"] == "accept"
    assert (v2["live"], v2["outcome"]) == (False, "promoted")


async def test_an_ended_challengers_evidence_stops_at_its_decision(
    client: httpx.AsyncClient,
) -> None:
    d = (await client.get(url("arith"), headers=A)).json()
    v2, v3 = d["challengers"]
    assert v2["sprt"]["points"][-1]["comparisons"] == len(expected_path(SprtPolicy())) - 1
    assert v2["sprt"]["points"][-1]["llr"] == pytest.approx(d["decisions"][0]["llr"])
    assert v2["runs"] == 12  # not the 13th run, graded after the promotion
    assert v3["record"]["capped"] == 1


async def test_wins_losses_draws_judge_and_verifier_apart(client: httpx.AsyncClient) -> None:
    d = (await client.get(url("arith"), headers=A)).json()
    v2 = next(c for c in d["challengers"] if c["version"] == V["v2"])
    assert v2["record"] == {
        "judge_wins": 8,
        "judge_losses": 1,
        "draws": 1,
        "verifier_wins": 2,
        "verifier_losses": 0,
        "capped": 0,
    }


async def test_pass_rates_on_selection_and_held_out_and_the_gap(
    client: httpx.AsyncClient,
) -> None:
    d = (await client.get(url("arith"), headers=A)).json()
    v2 = next(c for c in d["challengers"] if c["version"] == V["v2"])
    assert v2["pass_rate"] == pytest.approx(11 / 12)
    assert v2["baseline_pass_rate"] == pytest.approx(6 / 10)
    assert v2["held_out"]["pass_rate"] == pytest.approx(2 / 4)
    assert v2["gap"] == pytest.approx(11 / 12 - 2 / 4)


async def test_rollbacks_and_rejections_carry_their_reasons(client: httpx.AsyncClient) -> None:
    d = (await client.get(url("arith"), headers=A)).json()
    outcomes = [(x["outcome"], x["version"]) for x in d["decisions"]]
    assert outcomes == [("promoted", V["v2"]), ("rolled_back", V["v3"])]
    rollback = d["decisions"][1]
    assert (rollback["reason"], rollback["trigger"], rollback["rung"]) == (
        ROLLBACK_REASON,
        "capped",
        "shadow",
    )
    [proposal] = d["proposals"]
    assert (proposal["status"], proposal["review"]) == ("rejected", REJECT_REASON)


async def test_tournament_strengths_against_control(client: httpx.AsyncClient) -> None:
    d = (await client.get(url(TOURNEY), headers=A)).json()
    [t2] = d["challengers"]
    assert t2["live"] is True
    rows = [(s["tasks"], s["mean"], s["low"], s["high"], s["episodes"]) for s in t2["strengths"]]
    assert rows == [
        ("selection", STRENGTH.mean, *STRENGTH.interval, STRENGTH.episodes),
        ("held_out", HELD_OUT_STRENGTH.mean, *HELD_OUT_STRENGTH.interval, 3),
    ]
    assert t2["sprt"]["decision"] == "continue"


async def test_another_tenants_workflow_is_a_404_like_a_missing_one(
    client: httpx.AsyncClient,
) -> None:
    theirs = await client.get(url("secret"), headers=A)
    missing = await client.get(url("nothing"), headers=A)
    assert theirs.status_code == missing.status_code == 404
    assert theirs.json() == missing.json() == {"detail": "no such workflow"}
    page = await client.get(url("secret", api=False), headers=A)
    assert page.status_code == 404
    assert V["s1"][:12] not in page.text
    named = await client.get(url("secret"), headers=A, params={"tenant": str(TENANT_B)})
    assert named.status_code == 404
    listed = await client.get("/api/workflows", headers=A, params={"tenant": str(TENANT_B)})
    assert listed.status_code == 404


@pytest.mark.parametrize(
    ("path", "params", "named"),
    [
        ("/api/workflows", {"colour": "red"}, "unknown parameter: colour"),
        (url("arith"), {"limit": "3"}, "unknown parameter: limit"),
        (url("x" * 300), {}, "workflow id"),
    ],
)
async def test_bad_input_names_the_problem(
    client: httpx.AsyncClient, path: str, params: dict[str, str], named: str
) -> None:
    response = await client.get(path, headers=A, params=params)
    assert response.status_code == 400
    assert named in response.json()["detail"]


async def test_hostile_names_and_reasons_are_escaped(client: httpx.AsyncClient) -> None:
    for path in ("/workflows", url(TOURNEY, api=False), url("arith", api=False)):
        page = await client.get(path, headers=A)
        assert page.status_code == 200, path
        assert "<script>window" not in page.text
        assert "<img src=x" not in page.text
    listed = await client.get("/workflows", headers=A)
    assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in listed.text
    assert quote(TOURNEY, safe="") in listed.text  # the link carries the name, encoded
    detail = await client.get(url("arith", api=False), headers=A)
    assert "no: &lt;script&gt;" in detail.text
    polled = await client.get(url("arith", api=False), headers=A | {"x-console-poll": "1"})
    assert "no: &lt;script&gt;" in polled.text  # the live fragment is escaped alike
    assert "<script>window" not in polled.text
    assert "<html" not in polled.text
    raw = (await client.get(url(TOURNEY), headers=A)).json()
    assert raw["workflow"]["workflow_id"] == TOURNEY
    assert HOSTILE in TOURNEY


async def test_the_pages_draw_the_path_and_the_forest(client: httpx.AsyncClient) -> None:
    page = (await client.get(url("arith", api=False), headers=A)).text
    assert page.count('class="step"') == len(expected_path(SprtPolicy())) + 1  # v2's and v3's
    tourney = (await client.get(url(TOURNEY, api=False), headers=A)).text
    assert tourney.count('class="strength"') == 2


def evidence(wins: int, policy: SprtPolicy) -> EvidenceSeen:
    """A challenger's evidence after `wins` judge wins, under `policy`."""
    return EvidenceSeen(
        at=datetime(2026, 6, 1, tzinfo=UTC) + timedelta(minutes=wins),
        workflow_version=V["v2"],
        baseline_version=V["v1"],
        record=WinRecord(judge_wins=wins),
        runs=wins,
        passes=wins,
        baseline_runs=0,
        baseline_passes=0,
        strength=None,
        held_out=None,
        order_checked=0,
        order_inconsistent=0,
        llr=llr(wins, 0, policy),
        policy=policy,
        upper=policy.upper,
        lower=policy.lower,
    )


async def test_points_under_an_earlier_policy_are_drawn_apart() -> None:
    old, new = SprtPolicy(p1=0.8), SprtPolicy()
    path = sprt_path([evidence(1, old), evidence(2, old), evidence(2, new), evidence(3, new)])
    assert [(p.comparisons, p.policy_changed) for p in path.points] == [
        (0, True),
        (1, True),
        (2, False),  # republished under the new policy: the newest stands
        (3, False),
    ]
    assert (path.upper, path.p1) == (new.upper, new.p1)
    chart = sprt_chart(path)
    assert len(chart.earlier.split()) == 3  # the origin to the first point under `new`
    assert len(chart.path.split()) == 2
    assert chart.crossing is None
    assert chart.lower_y > chart.zero_y > chart.upper_y  # the ratio grows upwards


async def test_each_version_links_to_its_runs(client: httpx.AsyncClient) -> None:
    page = (await client.get(url(TOURNEY, api=False), headers=A)).text
    query = urlencode({"tenant": str(TENANT_A), "workflow": TOURNEY, "version": V["t2"]})
    assert f'href="/runs?{query.replace("&", "&amp;")}"' in page
    runs = await client.get(f"/runs?{query}", headers=A)
    assert runs.status_code == 200
