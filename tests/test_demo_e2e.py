"""The embedded demo end to end: v2 is promoted and every stage re-folds byte for byte."""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import pytest

from assay.cli.demo import DEMO_TENANT, demo
from assay.cli.health import health_command
from assay.cli.rebuild import rebuild
from assay.record import StateKey
from assay.runtime import Embedded
from assay.workflow import load_workflow

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

pytestmark = pytest.mark.slow


async def test_demo_climbs_the_ladder_rolls_back_v3_and_rebuilds_identically(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    assert await demo(data, tasks=None, workflows=None, limit=None, progress=False) == 0
    out = capsys.readouterr().out
    assert "PROMOTED v2" in out
    assert "shadow -> trial -> current" in out
    assert "v3: ROLLED BACK from shadow: 1 Core violation" in out
    assert "slow loop: no proposal after v3: nothing left to propose" in out
    assert "held out)" in out
    v1, v2, v3 = (load_workflow(EXAMPLES / "workflows" / f"arith-v{n}.yaml") for n in (1, 2, 3))
    async with Embedded(data) as rt:
        promoted = await rt.logs["decide"].get(StateKey(DEMO_TENANT, "decision", v2.version))
        rolled = await rt.logs["decide"].get(StateKey(DEMO_TENANT, "decision", v3.version))
        alloc = await rt.logs["decide"].get(StateKey(DEMO_TENANT, "allocation", v1.id))
        tallies = dict(await rt.logs["aggregate"].scan(DEMO_TENANT, "version"))
        tasks = [doc for _, doc in await rt.logs["ingest"].scan(DEMO_TENANT, "task")]
        stored = await rt.logs["ingest"].get(StateKey(DEMO_TENANT, "definition", v3.version))
    assert promoted is not None
    assert (promoted["outcome"], promoted["rung"]) == ("promoted", "trial")
    assert rolled is not None
    assert (rolled["outcome"], rolled["rung"], rolled["trigger"]) == (
        "rolled_back",
        "shadow",
        "capped",
    )
    assert alloc is not None
    assert (alloc["current"], alloc["challenger"]) == (v2.version, None)
    assert stored is not None  # rolled back, never deleted: v3 stays in the DAG
    assert stored["parents"] == [v2.version]
    rate = {k: v["passes"] / v["runs"] for k, v in tallies.items()}
    assert rate[v2.version] > rate[v1.version]
    assert tallies[v1.version]["runs"] < tallies[v2.version]["runs"]  # v1 stopped serving
    assert tallies[v3.version]["runs"] < 40  # rolled back on its first capped episodes
    assert {t["arm"] for t in tasks} == {"current", "challenger"}  # v2 served on trial
    assert 0 < sum(t["held_out"] for t in tasks) < len(tasks)
    assert await rebuild(data, check=True) == 0


async def test_rebuild_check_fails_on_state_not_derived_from_the_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    assert await demo(data, tasks=None, workflows=None, limit=20, progress=False) == 0
    summary = capsys.readouterr().out
    assert await health_command(data, None) == 0  # the grading meter the demo left
    (health,) = json.loads(capsys.readouterr().out)
    assert health["tenant"] == str(DEMO_TENANT)
    assert health["judge_calls_total"] == sum(health["judge_calls_by_purpose"].values()) > 0
    # the summary's judge figure is the meter's, as `assay grade health` reads it
    by_purpose = ", ".join(f"{p} {n}" for p, n in health["judge_calls_by_purpose"].items())
    line = re.search(r"judge calls +(.*)", summary)
    assert line is not None
    assert line[1] == f"{health['judge_calls_total']} answered ({by_purpose})"
    assert health["judge_failures"] == 0  # the stub judge always answers
    assert health["scores"]["ungraded:no_reference"] > 0  # the current version's first episodes
    assert not health["budget_exhausted"]
    replay = health["replay"]  # the demo's challengers start on shadow: their replays spent
    assert (replay["calls_ceiling"], replay["runs_cut_total"]) == (None, 0)  # no ceiling set
    assert replay["model_calls_total"] > 0
    with sqlite3.connect(data / "aggregate.sqlite") as db:
        db.execute("UPDATE state SET value = ? WHERE kind = 'version'", (json.dumps({}),))
    assert await rebuild(data, check=True) == 1
    assert await rebuild(data, check=False) == 1  # repairs: reports, then keeps the rebuilt state
    assert await rebuild(data, check=True) == 0


async def test_a_tournament_mode_workflow_is_graded_embedded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same tournament grading as in distributed mode, in one process on SQLite."""
    data = tmp_path / "data"
    ranked = [EXAMPLES / "workflows" / f"arith-ranked-v{n}.yaml" for n in (1, 2)]
    assert await demo(data, tasks=None, workflows=ranked, limit=24, progress=False) == 0
    assert "SPRT decision                 pending" in capsys.readouterr().out
    challenger = load_workflow(ranked[1])
    async with Embedded(data) as rt:
        tally = await rt.logs["aggregate"].get(StateKey(DEMO_TENANT, "version", challenger.version))
        groups = await rt.logs["tournament"].scan(DEMO_TENANT, "group")
    assert tally is not None
    assert tally["ranked"]["n"] > 0  # anchored deltas from control, folded in
    assert all(doc["members"] == 0 for _, doc in groups)  # every group closed ...
    assert sum(doc["epoch"] for _, doc in groups) >= len(groups)  # ... once, into a new epoch
    assert await rebuild(data, check=True) == 0
